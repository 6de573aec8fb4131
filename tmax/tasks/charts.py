"""PNG charts of a scored job: pass rate per task and per category (matplotlib).

matplotlib comes with the `bench` (or `train`) extra; without it every chart of tmax is
skipped with `ChartsUnavailable`, which the CLI reports as a one-line note."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tmax.tasks.scoring import Score

NO_MATPLOTLIB = "no chart: matplotlib is not installed (pip install 'tmax[bench]')"


class ChartsUnavailable(RuntimeError):
    """matplotlib is missing: the chart is skipped, the rest of the command goes on."""


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display on servers); every chart of tmax
    starts here. ChartsUnavailable when matplotlib is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ChartsUnavailable(NO_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bar(ax, labels: list[str], values: list[float], title: str) -> None:
    ax.barh(range(len(labels)), [v * 100 for v in values], color="#4477aa")
    ax.set_yticks(range(len(labels)), labels, fontsize=7 if len(labels) > 20 else 9)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("mean reward (%)")
    ax.set_title(title)
    for i, v in enumerate(values):
        ax.text(min(v * 100 + 1, 92), i, f"{v * 100:.0f}", va="center", fontsize=7)


def write_charts(sc: Score, out_dir: Path, title: str = "") -> list[Path]:
    plt = pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = sorted(sc.tasks, key=lambda r: (-r.mean_reward, r.task))
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.22 * max(1, len(rows))))
    _bar(ax, [r.task for r in rows], [r.mean_reward for r in rows],
         f"{title} pass rate per task (mean {sc.mean_reward * 100:.1f}%)".strip())
    fig.tight_layout()
    p = out_dir / "pass_rate_by_task.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    cats = sorted(sc.categories.items(), key=lambda kv: (-kv[1], kv[0]))
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.3 * max(1, len(cats))))
    _bar(ax, [c for c, _ in cats], [v for _, v in cats], f"{title} pass rate per category".strip())
    fig.tight_layout()
    p = out_dir / "pass_rate_by_category.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
