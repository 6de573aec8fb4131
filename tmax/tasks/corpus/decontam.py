"""`tmax data decontam`: word n-gram overlap of task instructions with a benchmark's.

Text is lower-cased and split on runs of non-alphanumerics; n-grams (default 13) are
taken with stride 1. A task is a hit against a benchmark task when they share at least
one n-gram; `shared_ngrams` counts the distinct shared ones.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tmax.tasks.corpus.corpus import read_corpus

DEFAULT_N = 13
_SPLIT = re.compile(r"[^0-9a-z]+")


def tokens(text: str) -> list[str]:
    return [t for t in _SPLIT.split(text.lower()) if t]


def ngrams(text: str, n: int = DEFAULT_N) -> set[tuple[str, ...]]:
    words = tokens(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _benchmark(bench_dir: Path) -> dict[str, str]:
    """Instructions of every task under a benchmark directory (any depth)."""
    out = {}
    for ins in sorted(Path(bench_dir).rglob("instruction.md")):
        out[ins.parent.name] = ins.read_text(encoding="utf-8", errors="replace")
    if not out:
        raise ValueError(f"{bench_dir}: no instruction.md found (is it a benchmark directory?)")
    return out


def find_hits(corpus: Path, bench_dir: Path, n: int = DEFAULT_N) -> dict:
    """{"hits": [{task, benchmark_task, shared_ngrams}], "checked": N, "unreadable": {task: why}};
    a task whose task.toml does not read is reported and the rest are checked."""
    if n < 1:
        raise ValueError("n must be at least 1")
    bench = {name: ngrams(text, n) for name, text in _benchmark(bench_dir).items()}
    # One index from n-gram to benchmark tasks, so each corpus task is one pass over its n-grams.
    index: dict[tuple[str, ...], list[str]] = {}
    for name, grams in bench.items():
        for g in grams:
            index.setdefault(g, []).append(name)
    corpus_read = read_corpus(corpus)
    tasks = corpus_read.tasks
    hits = []
    for t in tasks:
        shared: dict[str, int] = {}
        for g in ngrams(t.instruction, n):
            for b in index.get(g, ()):
                shared[b] = shared.get(b, 0) + 1
        hits += [{"task": t.name, "benchmark_task": b, "shared_ngrams": k} for b, k in sorted(shared.items())]
    return {"hits": hits, "checked": len(tasks), "unreadable": corpus_read.unreadable}


def copy_without(corpus: Path, dest: Path, drop: set[str]) -> list[str]:
    """Copy the corpus to `dest` leaving out the named tasks; returns the kept names."""
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} exists and is not empty")
    kept = []
    for t in read_corpus(corpus):
        if t.name in drop:
            continue
        shutil.copytree(t.path, dest / t.name, symlinks=True)
        kept.append(t.name)
    return kept
