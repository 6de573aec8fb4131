"""What a run reports: per-step metrics (one JSON line per step, always; wandb /
tensorboard when asked for), the step clock behind its time figures, the console progress
bar, the reward curve and the summary.

The JSONL file is the record of a run: each line is written with a single write and
flushed, so a crash loses at most the line being written, and `read_metrics` skips a
truncated last line; `trim_jsonl` drops it (and a killed run's steps past its checkpoint)
before a resumed run appends, so a cut line never swallows the next record.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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


def trim_jsonl(path: Path, keep: Any = None) -> int:
    """Rewrite a JSONL record atomically with only its complete lines (and of those, the ones
    `keep(record)` accepts); returns how many lines were dropped. A missing file is left be."""
    import os
    import tempfile

    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if keep is None or keep(record):
            kept.append(line)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def summary(metrics: dict[str, Any]) -> dict[str, str]:
    """Short label -> formatted value for the console, for the keys present."""
    out = {}
    for key, label in CONSOLE_KEYS:
        if key in metrics:
            v = metrics[key]
            out[label] = f"{v:.4g}" if isinstance(v, float) else str(v)
    return out


class LearnProgress(Protocol):
    """What a run tells the display that follows it (the CLI draws it: `tmax_cli.progress`);
    training itself draws nothing."""

    def environments(self, done: int, total: int) -> None:
        """`done` of `total` task environments resolved, before the first step."""

    def begin(self, total: int, done: int) -> None:
        """Training of `total` steps starts, `done` of them already run (a resume)."""

    def update(self, step: int, info: dict[str, str]) -> None:
        """`step` finished; `info` holds its key figures, label -> text."""

    def note(self, text: str) -> None:
        """A line for people, between the updates."""

    def close(self) -> None: ...


class NoProgress:
    """The display of a run nobody watches (logs only)."""

    def environments(self, done: int, total: int) -> None: ...

    def begin(self, total: int, done: int) -> None: ...

    def update(self, step: int, info: dict[str, str]) -> None: ...

    def note(self, text: str) -> None: ...

    def close(self) -> None: ...


def reward_curve(metrics_path: Path, out_png: Path) -> str | None:
    if not metrics_path.exists():
        return None
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    from tasks.charts import pyplot

    plt = pyplot()

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("train/reward_all_rollouts", "all rollouts"),
                       ("val/avg_group_performance_pre_filter", "groups, pre-filter"),
                       ("val/avg_group_performance_post_filter", "groups, post-filter")):
        ys = [r.get(key) for r in rows]
        if any(isinstance(y, (int, float)) for y in ys):
            ax.plot(steps, [y if isinstance(y, (int, float)) else float("nan") for y in ys], marker=".", label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("tmax learn: training reward")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return str(out_png)


def run_summary(metrics_path: Path, setup_s: float, run_s: float) -> dict[str, Any]:
    rows = read_metrics(metrics_path) if metrics_path.exists() else []

    def avg(key: str, part: list[dict]) -> float | None:
        vals = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return round(sum(vals) / len(vals), 4) if vals else None

    k = max(1, len(rows) // 4)
    first, last = rows[:k], rows[-k:]
    return {
        "steps": len(rows),
        "setup_s": round(setup_s, 1),
        "run_s": round(run_s, 1),
        "reward_first_quarter": avg("train/reward_all_rollouts", first),
        "reward_last_quarter": avg("train/reward_all_rollouts", last),
        "post_filter_reward_first_quarter": avg("val/avg_group_performance_post_filter", first),
        "post_filter_reward_last_quarter": avg("val/avg_group_performance_post_filter", last),
        "mask_frac_kept_mean": avg("debug/dppo_mask_frac_kept", rows),
        "logprob_diff_max_mean": avg("debug/vllm_vs_local_logprob_diff_max", rows),
        "train_step_s_mean": avg("time/training", rows),
        "weight_sync_s_mean": avg("time/weight_sync", rows),
        "episodes": rows[-1].get("episode") if rows else 0,
    }


ENV_METRIC = "env/tmax_bash/step_count"


def rollout_metrics(rollouts: list) -> dict[str, float]:
    """Means over `rollouts` (`training.rollout.Rollout`): lengths, endings, rewards, times."""
    n = max(1, len(rollouts))
    lengths = [len(r.ids) for r in rollouts] or [0]
    return {
        ENV_METRIC: sum(r.steps for r in rollouts) / n,
        "tools/bash/avg_calls_per_rollout": sum(sum(1 for _ in r.turn_versions) for r in rollouts) / n,
        "val/sequence_lengths": sum(lengths) / n,
        "val/sequence_lengths_min": float(min(lengths)),
        "val/sequence_lengths_max": float(max(lengths)),
        "val/stop_rate": sum(1 for r in rollouts if not r.truncated) / n,
        "val/truncated_completion_fraction": sum(1 for r in rollouts if r.truncated) / n,
        "val/non_submitting_completion_fraction": sum(1 for r in rollouts if not r.submitted) / n,
        "objective/verifiable_reward": sum(r.reward for r in rollouts) / n,
        "objective/verifiable_correct_rate": sum(1 for r in rollouts if r.reward >= 1.0) / n,
        "time/episode_mean_s": sum(r.timings.get("total_s", 0.0) for r in rollouts) / n,
        "time/sandbox_start_mean_s": sum(r.timings.get("sandbox_start_s", 0.0) for r in rollouts) / n,
        "env/warm_start_frac": sum(1 for r in rollouts if r.warm_start) / n,
    }


@dataclass
class StepClock:
    """Wall-time bookkeeping of the step being gathered and trained."""

    run_start: float
    wait_started: float  # end of the previous step: from here the loop waits for a batch
    last_tick: float
    step_wall_start: float
    wait_s: float = 0.0
    train_started: float = 0.0
    busy_s: float = 0.0  # time with at least one episode in flight (sampler busy)

    @classmethod
    def now(cls) -> "StepClock":
        t = time.monotonic()
        return cls(run_start=t, wait_started=t, last_tick=t, step_wall_start=t)

    def tick(self, sampling: bool, now: float) -> None:
        """Credit the time since the last tick to the sampler when episodes were in flight.
        (An approximation: it counts the interval as busy when episodes are pending at its end.)"""
        if sampling:
            self.busy_s += now - self.last_tick
        self.last_tick = now

    def new_step(self, now: float) -> None:
        """The next step's wall starts here; sampler time before it belongs to the last step."""
        self.busy_s, self.step_wall_start, self.last_tick = 0.0, now, now

    def sampler_busy_frac(self, now: float) -> float:
        """Share of the step's wall with at least one episode in flight. 0 is a real value: with
        async steps, a step's batch (and the next one's) can all be sampled during the step before."""
        return min(1.0, self.busy_s / max(1e-9, now - self.step_wall_start))
