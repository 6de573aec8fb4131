"""Checkpoints: an HF model directory that `tmax serve` / vLLM can serve as is, plus the
trainer state needed for `--resume`.

Layout of one checkpoint directory (`<run>/checkpoints/step_<N>`):

    config.json, generation_config.json, model.safetensors   HF weights (save_pretrained)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   copied from the source model
    trainer_state.pt     optimizer state, step, RNG states (torch.load with weights_only)
    trainer_state.json   step, time and the caller's `extra` dict (readable, JSON)
    health.json          the collapse guard's mark, when it has judged the checkpoint:
                         "healthy" (no alarm in the steps after it) or "collapsed" (the run
                         rolled back past it); no file = not judged

Writes go to a hidden sibling temp directory that is renamed into place, so a crash never
leaves a half-written checkpoint under the final name; `remove_partial` deletes the temp
directories a killed run left. Before writing, the filesystem must have room for the
checkpoint's tensors (`DiskFullError` names the path and the bytes needed otherwise).
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from tmax.common.errors import ConfigError
from tmax.common.files import trim_jsonl
from tmax.common.records import (CHECKPOINT_META, HEALTH, CheckpointExtra, CheckpointMeta, HealthMark, HealthRecord,
                                 LearnRunDir, RecordError, metric, read_optional, read_record, write_record)

# Files a tokenizer / chat template may live in; whatever of these the source has is copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
STATE_PT = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return LearnRunDir(Path(run_dir)).checkpoint(step)


def checkpoint_meta(path: str | Path) -> CheckpointMeta:
    """trainer_state.json of a checkpoint directory."""
    return read_record(Path(path) / CHECKPOINT_META, CheckpointMeta)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


class DiskFullError(OSError):
    """The filesystem under a run cannot hold what must be written next."""

    def __init__(self, path: str | Path, needed: int, free: int):
        self.path, self.needed, self.free = Path(path), needed, free
        super().__init__(errno.ENOSPC, f"{path}: no space for a checkpoint: it needs about {needed / 2**20:.1f} MiB, "
                                       f"{free / 2**20:.1f} MiB are free")

    def __reduce__(self):  # crosses Ray's process boundary whole
        return (DiskFullError, (self.path, self.needed, self.free))


def is_disk_full(e: BaseException) -> bool:
    """An out-of-space error, raised here or in a Ray actor (whose error wraps it as `cause`);
    safetensors reports one as its own error type, with the OS message."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, OSError):
        return cause.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(cause)


def full_disk_report(run_dir: str | Path, e: BaseException) -> str:
    """What a run stopped by a full disk tells its user: where, how much is free, how much a
    checkpoint needs, and which checkpoint `--resume` continues from."""
    cause = getattr(e, "cause", None) or e
    run_dir = Path(run_dir)
    last = latest_checkpoint(run_dir)
    if isinstance(cause, DiskFullError):
        needed = cause.needed
    else:  # a write elsewhere in the run (an engine's weights, a log): a checkpoint's size
        needed = sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) if last else 0
    free = shutil.disk_usage(run_dir).free
    return (f"the filesystem of {run_dir} is full: {free / 2**20:.1f} MiB free, a checkpoint needs about "
            f"{needed / 2**20:.1f} MiB ({cause}). " + (f"The last complete checkpoint, {last}, is intact: free "
            "space and continue with --resume" if last else "No checkpoint was written yet"))


def tensors_bytes(tree: Any) -> int:
    """Bytes of every distinct tensor in a (nested) state dict (tied weights count once)."""
    seen: dict[tuple[int, int], int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            seen[(x.data_ptr(), x.numel())] = x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return sum(seen.values())


def require_space(path: str | Path, needed: int) -> None:
    """Raise DiskFullError unless the filesystem of `path` (or its nearest existing parent)
    has `needed` bytes free."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed:
        raise DiskFullError(path, needed, free)


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    *,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: dict | None = None,
    extra: CheckpointExtra | None = None,
    tokenizer_dir: str | Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    write: bool = True,
) -> Path:
    """Write the checkpoint atomically; `write=False` (non-zero ranks) does nothing.
    `optimizer_state` is an already gathered `optimizer.state_dict()` (sharded learners
    gather it on every rank, so it is passed in instead of the optimizer)."""
    final = Path(path)
    if not write:
        return final
    meta = CheckpointMeta(step=step, time=time.time(), extra=extra or CheckpointExtra())
    state = {"format": 1, "step": step, "rng": rng_state()}
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    elif optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    # Tensors plus 5% and 1 MiB for metadata, tokenizer files and filesystem overhead.
    needed = tensors_bytes([state_dict if state_dict is not None else model.state_dict(), state])
    needed += needed // 20 + 2**20
    require_space(final.parent, needed)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        model.save_pretrained(str(tmp), state_dict=state_dict)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        torch.save(state, tmp / STATE_PT)
        (tmp / CHECKPOINT_META).write_text(meta.model_dump_json(indent=2))
        _replace_dir(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):  # the estimate was short: the same error as before the write
            raise DiskFullError(final.parent, needed, shutil.disk_usage(final.parent).free) from e
        raise
    return final


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """{"format", "step", "optimizer", "rng"} of a checkpoint directory (torch's state; its
    JSON record is `checkpoint_meta`)."""
    path = Path(path)
    pt, js = path / STATE_PT, path / CHECKPOINT_META
    if not pt.is_file() or not js.is_file():
        raise FileNotFoundError(f"{path} is not a trainer checkpoint (missing {STATE_PT} or {CHECKPOINT_META})")
    state = torch.load(pt, map_location="cpu", weights_only=True)
    if "optimizer" not in state:
        raise ValueError(f"{pt} holds no optimizer state")
    return state


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete `step_N` checkpoints of a run, oldest first."""
    root = LearnRunDir(Path(run_dir)).checkpoints
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / CHECKPOINT_META).is_file()]


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete the temp and replaced-checkpoint directories a killed run left behind (never
    loaded: only complete `step_N` directories count); returns what was removed."""
    root = LearnRunDir(Path(run_dir)).checkpoints
    if not root.is_dir():
        return []
    partial = [p for p in root.iterdir() if p.name.startswith(".step_") and (".tmp-" in p.name or ".old-" in p.name)]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


def mark_health(path: str | Path, mark: HealthMark, detail: dict[str, object] | None = None) -> None:
    """Record the guard's judgement of a checkpoint (atomically, next to its state)."""
    write_record(Path(path) / HEALTH, HealthRecord(mark=HealthMark(mark), time=time.time(), **(detail or {})))


def health(path: str | Path) -> HealthMark | None:
    """The checkpoint's health mark, or None when the guard never judged it (or its record
    was cut short)."""
    try:
        record = read_optional(Path(path) / HEALTH, HealthRecord)
    except RecordError:
        return None
    return record.mark if record is not None else None


def latest_checkpoint(run_dir: str | Path, healthy_only: bool = False) -> Path | None:
    """The newest checkpoint a run may continue from: never one marked "collapsed" (the
    guard rolled back past it); with `healthy_only`, the newest marked "healthy"."""
    found = [p for p in list_checkpoints(run_dir)
             if (health(p) == HealthMark.HEALTHY if healthy_only else health(p) != HealthMark.COLLAPSED)]
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, and never the newest one marked
    healthy (the guard's rollback target); returns what was removed."""
    found = list_checkpoints(run_dir)
    doomed = found[:-keep] if keep > 0 else found
    target = latest_checkpoint(run_dir, healthy_only=True)
    doomed = [p for p in doomed if p != target]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def trained_before(run_dir: str | Path) -> str | None:
    """What in `run_dir` shows that a run already trained there, or None. A fresh run there
    would append its steps to that run's metrics and rollouts, so it has to resume instead."""
    run_dir = Path(run_dir)
    found = list_checkpoints(run_dir)
    if found:
        return f"checkpoints up to {found[-1].name}"
    files = LearnRunDir(run_dir)
    for path in (files.metrics, files.rollouts):
        if path.is_file() and path.stat().st_size:
            return f"{path.name}, no checkpoint"
    return None


def refuse_fresh_run_over(run_dir: str | Path, resume: bool) -> None:
    """A run that does not resume starts only where no run trained before (`trained_before`)."""
    earlier = None if resume else trained_before(run_dir)
    if earlier:
        # --resume needs a checkpoint the guard did not reject, not just any checkpoint.
        how = "continue it with --resume" if latest_checkpoint(run_dir) else "nothing to resume from"
        raise ConfigError(f"{run_dir} already holds a run ({earlier}; {how}): pass another --out, or remove it")


def resume_point(run_dir: str | Path) -> tuple[int, CheckpointExtra, str]:
    """(step, the trainer state's extras such as stream positions, checkpoint path) to resume
    the run in `run_dir` from: its newest complete checkpoint the guard did not reject. A
    killed save's leftovers are removed first, and the records are cut back to that step."""
    run_dir = Path(run_dir)
    remove_partial(run_dir)  # a killed run's half-written checkpoint is never loaded
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {LearnRunDir(run_dir).checkpoints}")
    meta = checkpoint_meta(latest)
    files = LearnRunDir(run_dir)
    # A killed run's cut last lines and steps past the checkpoint (trained again) leave the record.
    trim_jsonl(files.metrics, lambda row: int(metric(row, "step") or 0) <= meta.step)
    trim_jsonl(files.rollouts)
    return meta.step, meta.extra, str(latest)
