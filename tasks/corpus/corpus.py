"""Reading a corpus: the task directories of a directory and their `[metadata]` axes."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from tasks.corpus.axes import load_axes, normalize_complexity
from tasks.dataset import task_dirs


class CorpusError(ValueError):
    pass


@dataclass
class CorpusTask:
    name: str
    path: Path
    metadata: dict
    instruction: str


def read_metadata(task_dir: Path) -> dict:
    """`[metadata]` of task.toml with complexity descriptions mapped to their keys."""
    try:
        data = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{task_dir / 'task.toml'}: {e}") from None
    return normalized_axes(dict(data.get("metadata") or {}))


def normalized_axes(meta: dict) -> dict:
    """Complexity descriptions (as the original stores them) mapped to the bundled keys."""
    axes = load_axes()
    for key, table in (("task_complexity", axes.task_complexity), ("command_complexity", axes.command_complexity)):
        if isinstance(meta.get(key), str):
            meta[key] = normalize_complexity(meta[key], table)
    return meta


def read_corpus(root: Path) -> list[CorpusTask]:
    root = Path(root).expanduser()
    if not root.is_dir():
        raise CorpusError(f"{root}: no such corpus directory")
    try:
        dirs = task_dirs(root)
    except ValueError as e:
        raise CorpusError(str(e)) from None
    out = []
    for d in dirs:
        ins = d / "instruction.md"
        text = ins.read_text(encoding="utf-8", errors="replace") if ins.is_file() else ""
        out.append(CorpusTask(d.name, d, read_metadata(d), text))
    return out
