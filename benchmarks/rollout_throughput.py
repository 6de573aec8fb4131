"""Rollout throughput by sandbox: episodes per minute of the same policy on the same nano
tasks at the same concurrency, with sandbox local, bwrap, podman with a warm pool, and
podman cold (each episode starts its own container).

The policy is scripted (each task's oracle turns through the real harness, token policy
and verifier), so the model's speed is out of the ratio and every episode does the same
work in every sandbox. Task images are built before timing starts, as `tmax learn` does.

    python benchmarks/rollout_throughput.py [--tasks N] [--concurrency C] [--pool P] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_mode(kind: str, task_dirs: list[str], tok, cfg, concurrency: int, pool_size: int) -> dict:
    """Run one episode per task, `concurrency` at a time; warm when pool_size > 0."""
    from training.nano.tasks import oracle_steps
    from training.rollout import EpisodeRequest, env_settings, prepare_tasks, prewarm, run_episode, worker_pool
    from training.learner.sft import ScriptedSampler, assistant_ids

    rcfg = cfg.rollout.model_copy(update={"sandbox": kind, "pool_size": pool_size})
    images = prepare_tasks(rcfg, task_dirs, log=lambda m: print(m, file=sys.stderr)).images
    settings = env_settings(rcfg)
    pool = worker_pool(rcfg, concurrency)
    turns = {d: [assistant_ids(tok, t, c) for t, c in oracle_steps(d)] for d in task_dirs}

    def one(i: int) -> dict:
        if pool is not None and i + concurrency < len(task_dirs):
            # The episode that will take this slot next: start its container now.
            nxt = task_dirs[i + concurrency]
            prewarm(pool, nxt, settings, images[nxt])
        d = task_dirs[i]
        r = run_episode(EpisodeRequest(d, i, 0, i), ScriptedSampler(list(turns[d])), tok, rcfg, settings=settings,
                        image=images[d], pool=pool)
        return {"reward": r.reward, "warm": r.warm_start, "start_s": r.timings["sandbox_start_s"]}

    if pool is not None:
        # A learn worker's pool fills while the learner trains between steps: time from a
        # filled pool, as the episodes of a step start.
        for d in task_dirs[:concurrency]:
            prewarm(pool, d, settings, images[d])
        pool.wait_warm(timeout=300)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(concurrency) as ex:
            results = list(ex.map(one, range(len(task_dirs))))
    finally:
        if pool is not None:
            pool.close()
    wall = time.monotonic() - t0
    n = len(results)
    return {"episodes": n, "seconds": round(wall, 2), "episodes_per_min": round(60 * n / wall, 2),
            "solved": sum(1 for r in results if r["reward"] >= 1.0), "warm_starts": sum(r["warm"] for r in results),
            "sandbox_start_mean_s": round(sum(r["start_s"] for r in results) / n, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=24, help="nano tasks (one episode each) per mode")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pool", type=int, default=4, help="containers started ahead, for podman warm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from training.config import preset
    from training.nano.model import build_tokenizer
    from training.nano.tasks import write_splits

    cfg = preset("nano")
    with tempfile.TemporaryDirectory(prefix="tmax-rollout-bench-") as tmp:
        build_tokenizer(args.seed).save_pretrained(Path(tmp) / "tok")
        tok = AutoTokenizer.from_pretrained(Path(tmp) / "tok")
        dirs = [str(d) for d in write_splits(Path(tmp) / "tasks", args.tasks, 1, seed=args.seed)["train"]]
        modes = {"local": ("local", 0), "bwrap": ("bwrap", 0), "podman_cold": ("podman", 0),
                 "podman_warm": ("podman", args.pool)}
        res = {name: run_mode(kind, dirs, tok, cfg, args.concurrency, pool) for name, (kind, pool) in modes.items()}
    out = {f"episodes_per_min_{name}": r["episodes_per_min"] for name, r in res.items()}
    out["podman_warm_vs_local"] = round(res["podman_warm"]["episodes_per_min"] / res["local"]["episodes_per_min"], 3)
    out["podman_warm_vs_cold"] = round(res["podman_warm"]["episodes_per_min"] / res["podman_cold"]["episodes_per_min"], 3)
    out.update({"concurrency": args.concurrency, "pool": args.pool, "tasks": args.tasks, "modes": res})
    if args.json:
        print(json.dumps(out))
        return
    for name, r in res.items():
        print(f"{name:<12} {r['episodes_per_min']:8.1f} episodes/min  ({r['episodes']} in {r['seconds']}s, "
              f"{r['solved']} solved, sandbox start {r['sandbox_start_mean_s']}s, {r['warm_starts']} warm)")
    print(f"podman warm / local: {out['podman_warm_vs_local']}   warm / cold: {out['podman_warm_vs_cold']}")


if __name__ == "__main__":
    main()
