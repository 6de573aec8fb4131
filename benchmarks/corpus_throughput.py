"""Corpus validation throughput: the same N tasks validated (all five gates) one at a time,
with the scheduler's local pool, and across two Ray nodes started on this machine (as the
multi-node tests do), side by side in one run; then the projected wall time of 15k tasks
on 8 nodes from the per-node rate of the two-node run.

The default tasks are small (the `good` fixture of the validate tests, run on bwrap): they
measure the scheduler and the gates' own overhead, not a task's build or test time. A real
corpus is dominated by its tasks' builds and tests; `--corpus DIR -e podman` measures one.
Nodes of the two-node cluster get `--cpus-per-node` CPUs each; the local pool runs
`--slots` jobs at once. Every mode gets a fresh work directory (nothing is resumed) after a
warm-up run (images built, Ray workers started). On one machine the two "nodes" share its
cores, so the two-node figure measures the Ray path's overhead, not two machines' capacity.

    python benchmarks/corpus_throughput.py [--tasks N] [--slots S] [--corpus DIR] [-e ENV] [--no-ray] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402
FIXTURE = ROOT / "tests" / "data" / "corpus" / "validate" / "good"
RESOURCE = "tmax_sandbox"
MB = 1024 * 1024


def small_corpus(dest: Path, n: int) -> Path:
    for i in range(n):
        shutil.copytree(FIXTURE, dest / f"good-{i:03d}")
    return dest


def timed(corpus: Path, work: Path, env: str, backend) -> tuple[float, dict]:
    from tmax.tasks.corpus.validate import counts, validate_corpus

    t0 = time.monotonic()
    reports = validate_corpus(corpus, work, env, backend=backend)
    return time.monotonic() - t0, counts(reports)


def two_nodes(cpus: int):
    """A 2-node Ray cluster on this machine; each node advertises the sandbox resource."""
    from ray.cluster_utils import Cluster

    from tmax.training.cluster.launch import apply_ray_env

    apply_ray_env()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "resources": {RESOURCE: cpus},
                                                      "include_dashboard": False, "object_store_memory": 80 * MB})
    c.add_node(num_cpus=cpus, resources={RESOURCE: cpus}, object_store_memory=80 * MB)
    c.wait_for_nodes()
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4, help="jobs at once in the local pool")
    ap.add_argument("--cpus-per-node", type=int, default=2)
    ap.add_argument("--corpus", type=Path, help="validate this corpus instead of N small tasks")
    ap.add_argument("-e", "--env", default="bwrap")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from tmax.tasks.job_runner import LocalBackend

    with tempfile.TemporaryDirectory(prefix="tmax-corpus-bench-") as tmp:
        tmp = Path(tmp)
        corpus = args.corpus or small_corpus(tmp / "corpus", args.tasks)
        n = len([d for d in corpus.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))])
        timed(corpus, tmp / "warmup", args.env, LocalBackend(1))  # images built, caches warm
        out: dict = {"tasks": n, "env": args.env, "slots": args.slots}
        seq_s, seq_counts = timed(corpus, tmp / "sequential", args.env, LocalBackend(1))
        loc_s, loc_counts = timed(corpus, tmp / "local", args.env, LocalBackend(args.slots))
        out.update(seconds_sequential=round(seq_s, 2), seconds_local=round(loc_s, 2),
                   tasks_per_hour_sequential=round(n / seq_s * 3600, 1), tasks_per_hour_local=round(n / loc_s * 3600, 1),
                   speedup_local=round(seq_s / loc_s, 2), ok=[seq_counts["ok"], loc_counts["ok"]])
        if not args.no_ray:
            import ray

            from tmax.training.cluster.corpus_backend import RayBackend

            c = two_nodes(args.cpus_per_node)
            try:
                ray.init(address=c.address)
                backend = RayBackend(c.address, resource=RESOURCE)
                timed(corpus, tmp / "two-nodes-warmup", args.env, backend)  # workers started, modules imported
                backend.jobs_per_node.clear()
                two_s, two_counts = timed(corpus, tmp / "two-nodes", args.env, backend)
                out.update(seconds_two_nodes=round(two_s, 2), tasks_per_hour_two_nodes=round(n / two_s * 3600, 1),
                           jobs_per_node=sorted(backend.jobs_per_node.values()))
                out["ok"].append(two_counts["ok"])
                per_node = n / two_s * 3600 / 2
                out["projected_hours_15k_on_8_nodes"] = round(15000 / (per_node * 8), 2)
            finally:
                ray.shutdown()
                c.shutdown()
    record_result(args, out)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>34}: {v}")


if __name__ == "__main__":
    main()
