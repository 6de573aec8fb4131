"""Where two RL runs of the same seed part: the share of token-identical episodes per
policy version, and each run's asynchrony and collapse-guard verdicts.

    python benchmarks/run_divergence.py RUN_A RUN_B [--json]

RUN_A / RUN_B are RL run directories (`metrics.jsonl`, `rollouts.jsonl`; a recipe's `rl/`).
An episode of RUN_A is matched with RUN_B's episode of the same task, sample index and
policy version; they are identical when the whole token stream (prompt, sampled tokens,
observations) is. With the same seed, episodes sampled from the same weights differ only
where the environment answered differently, so identical streams at version 0 say the two
sandboxes gave the policy the same observations; after that, which groups fill which batch
depends on timing (asynchronous rollouts), the weights part, and so do the episodes.
Per run it prints the mean and largest lag of a step's samples behind the weights it
trains (steps), the share of multi-turn episodes sampled by two weight versions, and the
steps the collapse guard (`training.guard`, the preset's rule) marks alarm or collapse.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402
from tmax.training.guard import replay  # noqa: E402
from tmax.training.report import read_metrics  # noqa: E402
from tmax.training.rollout import Rollout  # noqa: E402


def load_rollouts(run: Path) -> list[Rollout]:
    return [Rollout.from_json(line) for line in (run / "rollouts.jsonl").read_text().splitlines() if line.strip()]


def _stream(r: Rollout) -> tuple:
    return tuple(tuple(t.prompt_ids) + tuple(t.ids) for t in r.traces)


def identical_by_version(a: list[Rollout], b: list[Rollout]) -> dict[int, tuple[int, int]]:
    """{policy version: (RUN_A episodes, of them token-identical in RUN_B)}."""
    other = {(r.task_id, r.sample_index, r.policy_version): _stream(r) for r in b}
    total, same = Counter(), Counter()
    for r in a:
        total[r.policy_version] += 1
        same[r.policy_version] += other.get((r.task_id, r.sample_index, r.policy_version)) == _stream(r)
    return {v: (total[v], same[v]) for v in sorted(total)}


def run_figures(run: Path, rollouts: list[Rollout]) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    steps = [r for r in rows if "model_step_mean" in r]
    multi = [r for r in rollouts if len(r.turn_versions) > 1]
    verdicts = replay(rows)
    return {
        "episodes": len(rollouts),
        "lag_mean": round(statistics.fmean(r["step"] - 1 - r["model_step_mean"] for r in steps), 3) if steps else None,
        "lag_max": max((r["step"] - 1 - r["model_step_min"] for r in steps), default=None),
        "mixed_version_share": round(sum(len(set(r.turn_versions)) > 1 for r in multi) / len(multi), 3) if multi else None,
        "format_error_share": round(sum(r.status == "format_errors" for r in rollouts) / len(rollouts), 3),
        "guard_alarm_steps": [v.step for v in verdicts if v.status == "alarm"],
        "guard_collapse_steps": [v.step for v in verdicts if v.collapse],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    a, b = load_rollouts(args.run_a), load_rollouts(args.run_b)
    by_version = identical_by_version(a, b)
    # The first version from which on fewer than half of RUN_A's episodes are in RUN_B as
    # they are (close weights still sample mostly the same tokens, so the share wavers first).
    parted = None
    for v, (n, same) in reversed(by_version.items()):
        if same >= n / 2:
            break
        parted = v
    out = {"identical_by_version": {str(v): {"episodes": n, "identical": s} for v, (n, s) in by_version.items()},
           "parted_at_version": parted,
           "run_a": run_figures(args.run_a, a), "run_b": run_figures(args.run_b, b)}
    record_result(args, out)
    if args.json:
        print(json.dumps(out))
        return
    for v, (n, s) in by_version.items():
        print(f"version {v:3d}: {s:4d} of {n:4d} episodes token-identical")
    print(f"parted at version {parted}")
    for name in ("run_a", "run_b"):
        print(name, json.dumps(out[name]))


if __name__ == "__main__":
    sys.exit(main())
