"""Reading a corpus: the task directories of a directory and their `[metadata]` axes.

A task whose task.toml cannot be read is not fatal: `read_corpus` returns it among the
`unreadable` tasks with the reason, and every command reports it and goes on with the rest.

Metadata written by other tools is mapped onto the axes: Terminal-Bench's `category`
(e.g. "software-engineering") becomes the domain when the task has none, spelled as the
axes file spells its buckets (`software_engineering`); a value that matches no bucket is
kept as it is and reported apart by `tmax data report`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tmax.tasks.corpus.axes import AxesConfig, load_axes, normalize_complexity
from tmax.tasks.dataset import task_dirs

# Metadata keys of other layouts that mean one of our axes (first present wins).
AXIS_ALIASES: dict[str, tuple[str, ...]] = {"domain": ("category",), "scenario": ("persona",)}
# Terminal-Bench categories with no bucket of their own spelling, and the domain they mean.
DOMAIN_SYNONYMS = {"mathematics": "scientific_computing", "machine_learning": "data_science",
                   "data_science_and_ml": "data_science", "system_administration_and_devops": "system_administration"}


class CorpusError(ValueError):
    pass


@dataclass
class CorpusTask:
    name: str
    path: Path
    metadata: dict
    instruction: str


@dataclass
class Corpus:
    tasks: list[CorpusTask] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # task name -> why

    def __iter__(self):
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)


def read_metadata(task_dir: Path, axes: AxesConfig | None = None) -> dict:
    """`[metadata]` of task.toml mapped onto the axes (see the module doc)."""
    try:
        data = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{task_dir / 'task.toml'}: {e}") from None
    meta = data.get("metadata")
    return normalized_axes(dict(meta) if isinstance(meta, dict) else {}, axes)


def _bucket_key(value: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", value.strip().lower()).strip("_")


def normalized_axes(meta: dict, axes: AxesConfig | None = None) -> dict:
    """Aliased keys and spellings mapped to the axes; complexity descriptions (as the
    original stores them) mapped to their keys."""
    axes = axes or load_axes()
    for axis, aliases in AXIS_ALIASES.items():
        if meta.get(axis) in (None, ""):
            found = next((meta[a] for a in aliases if isinstance(meta.get(a), str) and meta[a].strip()), None)
            if found is not None:
                meta[axis] = found
    if isinstance(meta.get("domain"), str) and meta["domain"] not in axes.domains:
        key = _bucket_key(meta["domain"])
        key = DOMAIN_SYNONYMS.get(key, key)
        if key in axes.domains:
            meta["domain"] = key
    for key, table in (("task_complexity", axes.task_complexity), ("command_complexity", axes.command_complexity)):
        if isinstance(meta.get(key), str):
            meta[key] = normalize_complexity(meta[key], table)
    return meta


def read_corpus(root: Path, axes: AxesConfig | None = None) -> Corpus:
    """Every task of a corpus; those whose task.toml does not read are listed apart."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise CorpusError(f"{root}: no such corpus directory")
    try:
        dirs = task_dirs(root)
    except ValueError as e:
        raise CorpusError(str(e)) from None
    out = Corpus()
    for d in dirs:
        try:
            meta = read_metadata(d, axes)
        except CorpusError as e:
            out.unreadable[d.name] = str(e)
            continue
        ins = d / "instruction.md"
        text = ins.read_text(encoding="utf-8", errors="replace") if ins.is_file() else ""
        out.tasks.append(CorpusTask(d.name, d, meta, text))
    return out
