"""`tmax data report`: counts per axis, the balance score, success-rate histograms, a PNG.

Balance (paper Eq. 1) = exp(H) / N with H = -sum p_i ln p_i and N the length of the
axis's declared bucket list (`AxesConfig.buckets`; domain N = 9). H is taken over the
tasks whose value is one of those buckets only, so the score lies in [1/N, 1] (1 is
uniform; no labelled task gives 0; N <= 1 gives 1). Per axis the report also states how
many tasks lack the axis (`missing`) and which values fall outside the buckets
(`outside_buckets`, e.g. an importer's "unknown"), so a corpus with unlabelled tasks
cannot pass for a balanced one. All nine axes are scored, as in the paper.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from tmax.common.records import RecordError, SolveSummary, read_record
from tmax.tasks.corpus.axes import AxesConfig, load_axes
from tmax.tasks.corpus.corpus import CorpusTask, read_corpus

SOLVE_DIR = ".tmax-solve"
BALANCE_AXES = ("domain", "skill_type", "primitive_skills", "scenario", "language", "task_complexity",
                "command_complexity", "verifier_kind", "fixture_kind")
COUNT_AXES = BALANCE_AXES + ("corpus_kind", "base_image")


def balance_score(counts: dict[str, int], n_buckets: int) -> float:
    total = sum(counts.values())
    if total == 0:
        return 0.0
    if n_buckets <= 1:
        return 1.0
    h = -sum((c / total) * math.log(c / total) for c in counts.values() if c > 0)
    return math.exp(h) / n_buckets


def _values(v) -> list[str]:
    if isinstance(v, list):
        return [str(x) for x in v]
    return [] if v is None or v == "" else [str(v)]


def axis_counts(tasks: list[CorpusTask]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(per axis: tasks per value, a list-valued axis counting each element; per axis:
    tasks lacking it)."""
    counts: dict[str, dict[str, int]] = {}
    missing: dict[str, int] = {}
    for axis in COUNT_AXES:
        c: Counter = Counter()
        lacking = 0
        for t in tasks:
            vals = _values(t.metadata.get(axis))
            lacking += not vals
            c.update(vals)
        missing[axis] = lacking
        if c:
            counts[axis] = dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))
    return counts, missing


def balances(counts: dict[str, dict[str, int]], axes: AxesConfig | None = None) -> tuple[dict, dict]:
    """(balance per axis over its declared buckets, values outside the buckets per axis)."""
    buckets = (axes or load_axes()).buckets()
    scores, outside = {}, {}
    for axis in BALANCE_AXES:
        declared = set(buckets[axis])
        have = counts.get(axis, {})
        scores[axis] = round(balance_score({v: c for v, c in have.items() if v in declared}, len(declared)), 6)
        outside[axis] = {v: c for v, c in have.items() if v not in declared}
    return scores, outside


def solve_summaries(root: Path) -> dict[str, dict[str, SolveSummary]]:
    """{solver tag: {task: summary}} from the `solve` summaries of a corpus (one that does
    not read is left out)."""
    out: dict[str, dict[str, SolveSummary]] = {}
    base = root / SOLVE_DIR
    if not base.is_dir():
        return out
    for tag_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        for f in sorted(tag_dir.glob("*.json")):
            try:
                out.setdefault(tag_dir.name, {})[f.stem] = read_record(f, SolveSummary)
            except (OSError, RecordError):
                continue
    return out


class SuccessHistogram(BaseModel):
    """One solver's per-task success rates c/n, binned."""

    k: list[int] | None  # attempts per task: [least, most]
    n: list[int] | None  # scored attempts per task: [least, most]
    bins: list[float]  # the bins' edges
    counts: list[int]  # tasks per bin
    tasks: int


class BalanceReport(BaseModel):
    """`tmax data report`: per axis, the tasks per value, the balance over the declared
    buckets, the tasks lacking it and the values outside the buckets; per solver, the
    success-rate histogram."""

    n: int  # tasks read
    balance: dict[str, float]
    missing: dict[str, int]
    outside_buckets: dict[str, dict[str, int]]
    buckets: dict[str, int]  # axis -> its number of declared buckets
    counts: dict[str, dict[str, int]]
    success_rate: dict[str, SuccessHistogram]  # solver tag -> histogram
    unreadable: dict[str, str]  # task -> why


def success_histograms(summaries: dict[str, dict[str, SolveSummary]], bins: int = 10) -> dict[str, SuccessHistogram]:
    """Per solver tag: the histogram of the per-task success rate c/n, with the attempts
    per task (k) and the scored runs per task (n) as ranges."""
    out = {}
    for tag, tasks in summaries.items():
        hist = [0] * bins
        ks, ns = [], []
        for s in tasks.values():
            rate = s.success_rate
            if rate is None:
                continue
            hist[min(bins - 1, int(rate * bins))] += 1
            ns.append(s.num_runs)
            ks.append(s.attempts)
        out[tag] = SuccessHistogram(k=[min(ks), max(ks)] if ks else None, n=[min(ns), max(ns)] if ns else None,
                                    bins=[round(i / bins, 3) for i in range(bins + 1)], counts=hist, tasks=sum(hist))
    return out


def build_report(root: Path, axes: AxesConfig | None = None) -> BalanceReport:
    axes = axes or load_axes()
    corpus = read_corpus(root, axes)
    counts, missing = axis_counts(corpus.tasks)
    scores, outside = balances(counts, axes)
    return BalanceReport(n=len(corpus.tasks), balance=scores, missing=missing, outside_buckets=outside,
                         buckets={a: len(b) for a, b in axes.buckets().items()}, counts=counts,
                         success_rate=success_histograms(solve_summaries(Path(root))), unreadable=corpus.unreadable)


def _range(r: list[int] | None) -> str:
    return "?" if not r else str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def histogram_title(tag: str, h: SuccessHistogram) -> str:
    return f"success rate c/n per task: {tag} (k = {_range(h.k)} attempts, n = {_range(h.n)} scored)"


def write_png(report: BalanceReport, path: Path) -> Path:
    from tmax.tasks.charts import pyplot

    plt = pyplot()

    axes = [a for a in ("domain", "skill_type", "task_complexity", "language") if a in report.counts]
    hists = report.success_rate
    panels = len(axes) + len(hists)
    fig, grid = plt.subplots(max(1, panels), 1, figsize=(8, 3.2 * max(1, panels)), squeeze=False)
    for ax, axis in zip(grid[:, 0], axes):
        c = report.counts[axis]
        ax.barh(list(c), list(c.values()), color="#4477aa")
        ax.invert_yaxis()
        ax.set_title(f"{axis} (balance {report.balance.get(axis, 0):.3f}, "
                     f"{report.missing.get(axis, 0)} task(s) missing)")
    for ax, (tag, h) in zip(grid[len(axes):, 0], hists.items()):
        ax.bar([f"{b:.1f}" for b in h.bins[:-1]], h.counts, color="#aa7744")
        ax.set_title(histogram_title(tag, h))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
