"""`tmax learn report RUN` for people: a `training.run_report.RunReport` as a few lines
(held-out before and after, time per stage, throughput, the reward's path as a
sparkline, the collapse guard's events)."""

from __future__ import annotations

from tmax.training.report import duration, guard_report
from tmax.training.run_report import RunReport

BLOCKS = "▁▂▃▄▅▆▇█"
STAGE_NAMES = {"build_s": "build", "environments_s": "environments", "sft_s": "SFT", "engine_start_s": "engine start",
               "sft_eval_s": "SFT eval", "rl_s": "RL", "rl_eval_s": "RL eval", "setup_s": "actors"}


def sparkline(values: list[float | None], low: float = 0.0, high: float = 1.0) -> str:
    """One block per value on the fixed scale [low, high] (rewards: 0 to 1), so two runs'
    lines compare; a missing value is a space."""
    span = max(high - low, 1e-9)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
            continue
        level = round((min(max(v, low), high) - low) / span * (len(BLOCKS) - 1))
        out.append(BLOCKS[level])
    return "".join(out)


def _pct(rate: float | None) -> str:
    return f"{rate:.1%}" if rate is not None else "-"


def _num(v: float | None, unit: str) -> str:
    return f"{v:,.0f} {unit}" if v is not None else f"- {unit}"


def render(r: RunReport) -> list[str]:
    lines = [f"run {r.run_dir}" + (f" (nano recipe, seed {r.seed})" if r.recipe else "")]
    if r.recipe:
        gain = f" ({r.gain_points:+.1f} points)" if r.gain_points is not None else ""
        lines.append(f"held-out pass rate: before RL {_pct(r.heldout_before)} -> after {_pct(r.heldout_after)}{gain}")
    stages = [f"{STAGE_NAMES.get(k, k)} {duration(v)}" + (f" (CPU {duration(c)})" if (c := r.stage_cpu_seconds.get(k)) else "")
              for k, v in r.stage_seconds.items() if k != "total_s"]
    if stages:
        total, cpu = r.stage_seconds.get("total_s"), r.stage_cpu_seconds.get("total_s")
        lines.append("time: " + ", ".join(stages) + (f"; total {total / 60:.1f} min" if total is not None else "")
                     + (f", CPU {cpu / 60:.1f} min on the run's processes" if cpu else ""))
    rewards = [x for x in r.rewards if x is not None]
    if r.updates:
        k = max(1, len(rewards) // 4)
        path = (f"training reward {sum(rewards[:k]) / k:.2f} -> {sum(rewards[-k:]) / k:.2f} (first -> last quarter)"
                if rewards else "no training reward logged")
        lines.append(f"RL: {r.steps} steps ({r.updates} trained), {r.episodes:,} episodes; {path}")
        lines.append(f"reward per step  {sparkline(r.rewards)}  (scale 0 to 1)")
        t = r.throughput
        lines.append(f"throughput: {_num(t.episodes_per_min, 'episodes/min')}, "
                     f"{_num(t.sampled_tokens_per_s, 'sampled tokens/s')}, "
                     f"{_num(t.learner_tokens_per_s, 'learner tokens/s')}")
    else:
        lines.append("RL: no step logged")
    lines += guard_report(r.guard)
    return lines
