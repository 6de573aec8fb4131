"""`tmax data report`: counts per axis, the balance score, pass@k histograms, a PNG.

Balance (paper Eq. 1) = exp(H) / N with H = -sum p_i ln p_i over the buckets that occur
and N the length of the axis's fixed bucket list (`AxesConfig.buckets`; domain N = 9). Its
range is [1/N, 1]; 1 is uniform. No tasks gives 0; N <= 1 gives 1.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from tasks.corpus.axes import AxesConfig, load_axes
from tasks.corpus.corpus import CorpusTask, read_corpus

SOLVE_DIR = ".tmax-solve"
BALANCE_AXES = ("domain", "skill_type", "task_complexity", "command_complexity", "language",
                "verifier_kind", "fixture_kind")
COUNT_AXES = BALANCE_AXES + ("scenario", "corpus_kind", "base_image", "primitive_skills")


def balance_score(counts: dict[str, int], n_buckets: int) -> float:
    total = sum(counts.values())
    if total == 0:
        return 0.0
    if n_buckets <= 1:
        return 1.0
    h = -sum((c / total) * math.log(c / total) for c in counts.values() if c > 0)
    return math.exp(h) / n_buckets


def axis_counts(tasks: list[CorpusTask]) -> dict[str, dict[str, int]]:
    """Per axis, tasks per value (a list-valued axis counts each element); absent = missing."""
    out: dict[str, dict[str, int]] = {}
    for axis in COUNT_AXES:
        c: Counter = Counter()
        for t in tasks:
            v = t.metadata.get(axis)
            if isinstance(v, list):
                c.update(str(x) for x in v)
            elif v is not None:
                c[str(v)] += 1
        if c:
            out[axis] = dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


def balances(counts: dict[str, dict[str, int]], axes: AxesConfig | None = None) -> dict[str, float]:
    buckets = (axes or load_axes()).buckets()
    return {axis: round(balance_score(counts.get(axis, {}), len(buckets[axis])), 6)
            for axis in BALANCE_AXES if axis in counts}


def solve_summaries(root: Path) -> dict[str, dict[str, dict]]:
    """{solver tag: {task: summary}} from the `solve` summaries of a corpus."""
    out: dict[str, dict[str, dict]] = {}
    base = root / SOLVE_DIR
    if not base.is_dir():
        return out
    for tag_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        for f in sorted(tag_dir.glob("*.json")):
            try:
                out.setdefault(tag_dir.name, {})[f.stem] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
    return out


def pass_histograms(summaries: dict[str, dict[str, dict]], bins: int = 10) -> dict[str, dict]:
    """Per solver tag: the histogram of per-task pass@k (k = the largest measured)."""
    out = {}
    for tag, tasks in summaries.items():
        values = []
        k = None
        for s in tasks.values():
            pk = s.get("pass_at_k") or {}
            if pk:
                k = max(int(x) for x in pk)
                values.append(float(pk[str(k)]))
        hist = [0] * bins
        for v in values:
            hist[min(bins - 1, int(v * bins))] += 1
        out[tag] = {"k": k, "bins": [round(i / bins, 3) for i in range(bins + 1)], "counts": hist,
                    "tasks": len(values)}
    return out


def build_report(root: Path, axes: AxesConfig | None = None) -> dict:
    tasks = read_corpus(root)
    counts = axis_counts(tasks)
    return {"n": len(tasks), "balance": balances(counts, axes), "counts": counts,
            "pass_at_k": pass_histograms(solve_summaries(Path(root)))}


def write_png(report: dict, path: Path) -> Path:
    from tasks.charts import pyplot

    plt = pyplot()

    axes = [a for a in ("domain", "skill_type", "task_complexity", "language") if a in report["counts"]]
    hists = report.get("pass_at_k") or {}
    panels = len(axes) + len(hists)
    fig, grid = plt.subplots(max(1, panels), 1, figsize=(8, 3.2 * max(1, panels)), squeeze=False)
    for ax, axis in zip(grid[:, 0], axes):
        c = report["counts"][axis]
        ax.barh(list(c), list(c.values()), color="#4477aa")
        ax.invert_yaxis()
        ax.set_title(f"{axis} (balance {report['balance'].get(axis, 0):.3f})")
    for ax, (tag, h) in zip(grid[len(axes):, 0], hists.items()):
        ax.bar([f"{b:.1f}" for b in h["bins"][:-1]], h["counts"], color="#aa7744")
        ax.set_title(f"pass@{h['k']} per task: {tag}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
