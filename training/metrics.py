"""Per-step metrics: one JSON line per step (always), wandb / tensorboard when asked for.

The JSONL file is the record of a run: each line is written with a single write and
flushed, so a crash loses at most the line being written, and `read_metrics` skips a
truncated last line.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

# The few metrics worth a console line, in display order, with short labels.
CONSOLE_KEYS = (
    ("val/avg_group_performance_post_filter", "reward"),
    ("val/avg_group_performance_pre_filter", "reward_pre"),
    ("loss/policy_avg", "loss"),
    ("debug/dppo_mask_frac_kept", "kept"),
    ("debug/vllm_vs_local_logprob_diff_max", "lp_diff_max"),
    ("optim/grad_norm", "grad"),
    ("batch/filtered_prompts", "filtered"),
    ("stale_results_dropped", "stale"),
    ("time/training", "t_train"),
)


def _clean(value: Any) -> Any:
    """JSON has no NaN / inf: write them as strings rather than produce invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):  # 0-d tensors / numpy scalars
        return _clean(value.item())
    return value


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb: bool = False,
        tensorboard: bool = False,
        project: str = "tmax",
        run_name: str | None = None,
        config: dict | None = None,
        filename: str = "metrics.jsonl",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb = None
        self._tb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError as e:
                raise RuntimeError("wandb logging was asked for but wandb is not installed (pip install wandb)") from e
            self._wandb = wandb_lib.init(project=project, name=run_name, config=config or {}, dir=str(self.run_dir))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(
                    "tensorboard logging was asked for but tensorboard is not installed (pip install tensorboard)"
                ) from e
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics JSONL file."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return records


def summary(metrics: dict[str, Any]) -> dict[str, str]:
    """Short label -> formatted value for the console, for the keys present."""
    out = {}
    for key, label in CONSOLE_KEYS:
        if key in metrics:
            v = metrics[key]
            out[label] = f"{v:.4g}" if isinstance(v, float) else str(v)
    return out
