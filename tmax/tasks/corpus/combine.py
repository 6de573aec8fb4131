"""`tmax data combine`: merge corpora as a tree of symlinks to the task directories.

union     every task of every corpus; a name in two corpora is an error
balanced  every non-intricate task, then randomly chosen intricate tasks up to --total
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from tmax.tasks.corpus.corpus import CorpusTask, read_corpus

MODES = ("union", "balanced")


class CombineError(ValueError):
    pass


def _all(corpora: list[Path]) -> list[CorpusTask]:
    seen: dict[str, Path] = {}
    out = []
    for c in corpora:
        corpus = read_corpus(c)
        if corpus.unreadable:  # a combined corpus would silently lose them
            name, why = next(iter(corpus.unreadable.items()))
            raise CombineError(f"{len(corpus.unreadable)} task(s) of {c} do not read, e.g. {name}: {why}")
        for t in corpus:
            if t.name in seen:
                raise CombineError(f"task {t.name} is in both {seen[t.name]} and {c}")
            seen[t.name] = c
            out.append(t)
    return out


def select(corpora: list[Path], mode: str, total: int | None = None, seed: int = 0) -> list[CorpusTask]:
    tasks = _all(corpora)
    if mode == "union":
        return tasks
    if mode != "balanced":
        raise CombineError(f"unknown mode {mode!r}: {', '.join(MODES)}")
    if total is None:
        raise CombineError("--mode balanced needs --total N")
    plain = [t for t in tasks if t.metadata.get("task_complexity") != "intricate"]
    intricate = [t for t in tasks if t.metadata.get("task_complexity") == "intricate"]
    if len(plain) > total:
        raise CombineError(f"{len(plain)} non-intricate tasks already exceed --total {total}")
    fill = random.Random(seed).sample(intricate, min(len(intricate), total - len(plain)))
    return plain + sorted(fill, key=lambda t: t.name)


def write_links(tasks: list[CorpusTask], dest: Path) -> Path:
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise CombineError(f"{dest} exists and is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        os.symlink(t.path.resolve(), dest / t.name, target_is_directory=True)
    return dest
