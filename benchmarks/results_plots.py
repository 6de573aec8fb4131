"""The plots of docs/RESULTS.md, drawn from recorded data: the nano recipe's held-out pass rate
before and after RL per run, and the collapse guard's rescue.

    python benchmarks/results_plots.py [--out docs/results]

Reads docs/results/notebook-figures.json (figures transcribed from the notebook), the guard's
recorded metric series in tests/data/guard/, and the runs recorded since with `--record`
(docs/results/nano_recipe.jsonl, collapse_guard.jsonl), so a new recorded run shows up in
the plots when this script is run again. Writes nano_recipe_heldout.png and collapse_guard.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import REPO, RESULTS_DIR, read_records  # noqa: E402

COLORS = {"host": "#1f77b4", "podman": "#ff7f0e"}


def lr_text(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")  # 5e-3, as the configs write it


def recorded(records: Path, name: str) -> list:
    path = records / f"{name}.jsonl"
    return read_records(path) if path.is_file() else []


def nano_runs(figures: dict, records: Path) -> list[dict]:
    """The transcribed runs, then every nano or nano-podman recipe run recorded since (LoRA and
    other configs are another recipe and are left out)."""
    runs = list(figures["nano_recipe_runs"])
    for rec in recorded(records, "nano_recipe"):
        argv, r = rec.argv, rec.result
        config = Path(argv[argv.index("--config") + 1]).stem if "--config" in argv else "nano"
        if config not in ("nano", "nano-podman") or r.get("rl_pass_rate") is None:
            continue
        runs.append({"commit": (rec.commit or "")[:7], "date": rec.date[:10], "seed": r["seed"],
                     "sandbox": "podman" if config == "nano-podman" else "host",
                     "sft_heldout": r["sft_pass_rate"], "rl_heldout": r["rl_pass_rate"], "minutes": r["minutes_total"]})
    return runs


def plot_nano(runs: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=100)
    ticks, x = [], 0.0
    for seed in sorted({r["seed"] for r in runs}):
        group = [r for r in runs if r["seed"] == seed]
        first = x
        for r in group:
            c = COLORS[r["sandbox"]]
            ax.plot([x, x], [100 * r["sft_heldout"], 100 * r["rl_heldout"]], color=c, lw=1.5, alpha=0.7)
            ax.scatter([x], [100 * r["sft_heldout"]], facecolors="white", edgecolors=c, s=36, zorder=3)
            ax.scatter([x], [100 * r["rl_heldout"]], color=c, s=36, zorder=3)
            x += 1
        ticks.append(((first + x - 1) / 2, f"seed {seed}\n({len(group)} runs)"))
        x += 1.5
    gains = [100 * (r["rl_heldout"] - r["sft_heldout"]) for r in runs]
    ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks])
    ax.set_ylim(0, 100)
    ax.set_ylabel("held-out pass rate, % (64 tasks x 2)")
    ax.set_title(f"nano recipe, {len(runs)} runs: after SFT (open) and after 20 RL steps (filled); "
                 f"median gain {sorted(gains)[len(gains) // 2]:+.1f} points", fontsize=10)
    for name, c in COLORS.items():
        ax.scatter([], [], color=c, label=f"{name} sandbox ({sum(r['sandbox'] == name for r in runs)})")
    ax.legend(loc="lower right", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def series(rel: str) -> list[dict]:
    return [json.loads(line) for line in (REPO / rel).read_text().splitlines() if line.strip()]


def plot_guard(figures: dict, records: Path, path: Path) -> None:
    import matplotlib.pyplot as plt

    g = figures["collapse_guard"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    healthy = series(g["series_healthy"])
    left.plot(range(1, len(healthy) + 1), [r["health/reward"] for r in healthy], color="grey", lw=1.2,
              label=f"LR {lr_text(g['healthy_lr'])} (the preset's), guard on: no rollback")
    rows = series(g["series_on_collapsing_lr"])
    left.plot(range(1, len(rows) + 1), [r["health/reward"] for r in rows], color="#2ca02c", lw=1.8, marker=".",
              label="LR 2e-3, guard on")
    for i, r in enumerate(rows, 1):
        if r.get("guard/rollback"):
            ev = r["guard/event"]
            left.axvline(i, color="#d62728", ls="--", lw=1)
            left.annotate(f"rollback to step {ev['to_step']}\nLR x{ev['lr_scale']:g}", (i, 0.93), fontsize=8,
                          color="#d62728", ha="left", xytext=(3, 0), textcoords="offset points")
    left.set_xlabel("RL update (rolled-back steps included)")
    left.set_ylabel("training reward")
    left.set_ylim(0, 1)
    left.legend(loc="lower right", fontsize=8)
    left.set_title("nano RL at a collapsing LR, seed 0: caught twice, then trains", fontsize=10)
    bars = [(f"LR {lr_text(c['lr'])}", c["heldout_off"], c["heldout_on"]) for c in g["collapsing_lr"]]
    bars += [(f"LR {lr_text(r.result['lr'])}\n{r.date[:10]}", r.result["heldout_off"], r.result["heldout_on"])
             for r in recorded(records, "collapse_guard") if "heldout_off" in r.result and "heldout_on" in r.result]
    off, on = g["healthy_heldout_off"], g["healthy_heldout_on"]
    bars.append((f"LR {lr_text(g['healthy_lr'])}\n{len(off)} seeds, mean", sum(off) / len(off), sum(on) / len(on)))
    xs = range(len(bars))
    right.bar([x - 0.2 for x in xs], [100 * b[1] for b in bars], 0.4, color="#7f7f7f", label="guard off")
    right.bar([x + 0.2 for x in xs], [100 * b[2] for b in bars], 0.4, color="#2ca02c", label="guard on")
    for x, (_, a, b) in zip(xs, bars):
        right.text(x - 0.2, 100 * a + 1, f"{100 * a:.0f}", ha="center", fontsize=8)
        right.text(x + 0.2, 100 * b + 1, f"{100 * b:.0f}", ha="center", fontsize=8)
    right.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    right.set_ylim(0, 100)
    right.set_ylabel("held-out pass rate after RL, %")
    right.legend(loc="upper left", fontsize=8)
    right.set_title("held-out after 20 RL steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the PNGs go (default: docs/results)")
    ap.add_argument("--records", type=Path, default=RESULTS_DIR,
                    help="where the --record files are read from (default: docs/results)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    figures = json.loads((RESULTS_DIR / "notebook-figures.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    plot_nano(nano_runs(figures, args.records), args.out / "nano_recipe_heldout.png")
    plot_guard(figures, args.records, args.out / "collapse_guard.png")
    print(f"wrote {args.out / 'nano_recipe_heldout.png'} and {args.out / 'collapse_guard.png'}")


if __name__ == "__main__":
    main()
