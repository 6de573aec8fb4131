"""Datasets are directories of task directories.

A registry-style name such as `terminal-bench@2.0` resolves to a local cache directory
(`$TMAX_DATASETS_DIR/<name>` or `~/.cache/tmax/datasets/<name>`): these machines cannot
download datasets, so the tasks must already be there.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

from tmax.tasks.task_format import Task, TaskError

DATASET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*@[A-Za-z0-9][A-Za-z0-9._-]*$")
TERMINAL_BENCH = "terminal-bench@2.0"


class DatasetError(ValueError):
    pass


def datasets_dir() -> Path:
    env = os.environ.get("TMAX_DATASETS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tmax" / "datasets"


def resolve(name_or_path: str | Path) -> Path:
    """A task or dataset directory for a path or a `name@version`."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p.resolve()
    name = str(name_or_path)
    if DATASET_NAME_RE.match(name):
        # `org/name@ver` and `name@ver` both live flat in the cache directory.
        cached = datasets_dir() / name.replace("/", "__")
        if cached.is_dir():
            return cached.resolve()
        raise DatasetError(
            f"dataset {name} is not in the local cache ({cached}). This machine cannot download "
            f"datasets: copy the task directories there (or set TMAX_DATASETS_DIR), or pass the "
            f"dataset directory itself."
        )
    raise DatasetError(f"{name}: no such task or dataset directory (and not a name@version dataset)")


def is_task_dir(p: Path) -> bool:
    return (p / "task.toml").is_file()


def task_dirs(root: Path) -> list[Path]:
    if is_task_dir(root):
        return [root]
    dirs = sorted(d for d in root.iterdir() if d.is_dir() and is_task_dir(d))
    if not dirs:
        raise DatasetError(f"{root}: neither a task (no task.toml) nor a dataset (no task directories inside)")
    return dirs


def select(names: list[str], include: list[str] | None = None, exclude: list[str] | None = None,
           limit: int | None = None) -> list[str]:
    """Harbor's -i / -x globs, then -l (applied after the filters)."""
    out = [n for n in names if not include or any(fnmatch.fnmatchcase(n, g) for g in include)]
    out = [n for n in out if not exclude or not any(fnmatch.fnmatchcase(n, g) for g in exclude)]
    if limit is not None:
        out = out[: max(0, limit)]
    return out


def load_tasks(name_or_path: str | Path, include: list[str] | None = None, exclude: list[str] | None = None,
               limit: int | None = None) -> list[Task]:
    """Load the selected tasks. Every broken task is reported, not just the first."""
    root = resolve(name_or_path)
    dirs = {d.name: d for d in task_dirs(root)}
    chosen = select(list(dirs), include, exclude, limit)
    if not chosen:
        raise DatasetError(f"{root}: no task matches the filters (include={include}, exclude={exclude})")
    tasks, errors = [], []
    for n in chosen:
        try:
            tasks.append(Task.load(dirs[n]))
        except TaskError as e:
            errors.append(str(e))
    if errors:
        raise DatasetError(f"{len(errors)} task(s) cannot be loaded:\n  " + "\n  ".join(errors))
    return tasks
