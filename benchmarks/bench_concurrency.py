"""How much does `-n 4` buy, and what does tmax add on top of the agent and verifier?

Runs the `oracle` agent over a fixed subset of tasks at -n 1 and at -n 4, with the
images built beforehand (so builds are not measured), and prints:

* the wall-time ratio (n1 / n4) as `speedup_n4`;
* tmax's per-trial overhead: trial wall time minus the time spent in the oracle's
  solve.sh and in the verifier's test.sh (container start/stop, copies, polling, records).

    python benchmarks/bench_concurrency.py [--dataset DIR] [--tasks a,b,c] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

from tmax.tasks.dataset import load_tasks  # noqa: E402
from tmax.tasks.task_images import ensure_image  # noqa: E402
from tmax.tasks.job import Job, JobSpec  # noqa: E402
from tmax.tasks.offline import default_config  # noqa: E402

DEFAULT_DATASET = Path(__file__).resolve().parents[2] / "shared" / "tb2-sample"
# Light tasks with quick oracles and verifiers (python and ubuntu bases).
DEFAULT_TASKS = ["regex-log", "polyglot-c-py", "sqlite-db-truncate", "llm-inference-batching-scheduler"]


def run(dataset: str, tasks: list[str], n: int, attempts: int, jobs_dir: str) -> dict:
    job = Job(JobSpec(job_name=f"bench-n{n}", jobs_dir=jobs_dir, dataset=dataset, include=tasks, agent="oracle",
                        n_attempts=attempts, n_concurrent=n))
    t0 = time.monotonic()
    data = job.run()
    wall = time.monotonic() - t0
    overheads, inner = [], []
    for r in job.results():
        total = r.wall_s or 0.0
        solve = ((r.agent_result.metadata if r.agent_result else None) or {}).get("duration_s", 0.0)
        test = (r.tmax.verifier_s if r.tmax else None) or 0.0  # test.sh itself
        inner.append(solve + test)
        overheads.append(total - solve - test)
    return {"n": n, "wall_s": wall, "trials": len(overheads), "mean_reward": data.tmax_score["mean_reward"],
            "overhead_s_per_trial": sum(overheads) / max(1, len(overheads)),
            "agent_verifier_s_per_trial": sum(inner) / max(1, len(inner))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(DEFAULT_DATASET))
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    ap.add_argument("-k", "--attempts", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    names = [t for t in args.tasks.split(",") if t]
    cfg = default_config()
    for t in load_tasks(args.dataset, include=names):
        ensure_image(t, cfg)  # built once, outside the measurement
    with tempfile.TemporaryDirectory(prefix="tmax-bench-") as tmp:
        r1 = run(args.dataset, names, 1, args.attempts, tmp)
        r4 = run(args.dataset, names, 4, args.attempts, tmp)
    out = {
        "tasks": names,
        "attempts": args.attempts,
        "wall_s_n1": round(r1["wall_s"], 2),
        "wall_s_n4": round(r4["wall_s"], 2),
        "speedup_n4": round(r1["wall_s"] / r4["wall_s"], 3),
        "overhead_s_per_trial": round(r1["overhead_s_per_trial"], 2),
        "overhead_s_per_trial_n4": round(r4["overhead_s_per_trial"], 2),
        "agent_verifier_s_per_trial": round(r1["agent_verifier_s_per_trial"], 2),
        "mean_reward_n1": r1["mean_reward"],
        "mean_reward_n4": r4["mean_reward"],
    }
    record_result(args, out)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"tasks: {', '.join(names)} (x{args.attempts})")
        print(f"-n 1: {out['wall_s_n1']:.1f}s   -n 4: {out['wall_s_n4']:.1f}s   speedup {out['speedup_n4']:.2f}x")
        print(f"tmax overhead per trial: {out['overhead_s_per_trial']:.1f}s at -n 1 "
              f"({out['overhead_s_per_trial_n4']:.1f}s at -n 4), on top of "
              f"{out['agent_verifier_s_per_trial']:.1f}s of solve.sh + test.sh")


if __name__ == "__main__":
    main()
