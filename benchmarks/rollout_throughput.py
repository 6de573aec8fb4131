"""Rollout throughput by sandbox: episodes per minute of the same policy on the same nano
tasks at the same concurrency, with sandbox local, bwrap, podman with a warm pool, and
podman cold (each episode starts its own container).

Two policies, through the real harness, token policy and verifier:
- scripted (default): each task's oracle turns, so the model's speed is out of the ratio
  and every episode does the same work in every sandbox. Episodes are shorter than a
  container start, so this measures sandbox overhead alone, the worst case for podman.
- `--model DIR`: a nano checkpoint (e.g. a `tmax learn` run's final one) served by vLLM
  with the preset's engine settings and sampled at the RL temperature, as a learn
  rollout worker does; the same seed per episode in every mode. Here the model and the
  containers share the CPU, and the warm pool can start containers while the model
  samples: the rollout workload of `tmax learn`.

Task images are built before timing starts, as `tmax learn` does.

    python benchmarks/rollout_throughput.py [--model DIR] [--tasks N] [--concurrency C] [--pool P] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def scripted_samplers(tok, task_dirs: list[str]):
    """Each task's oracle turns, replayed: a fresh sampler per episode."""
    from tmax.training.demos import ScriptedSampler, scripted_turns
    from tmax.training.nano.tasks import oracle_steps

    turns = {d: scripted_turns(tok, oracle_steps(d)) for d in task_dirs}
    return lambda d: ScriptedSampler(list(turns[d]))


def served_sampler(sampler):
    """One server for every episode; each episode's seed comes from its request."""
    return lambda d: sampler


def run_mode(kind: str, task_dirs: list[str], tok, cfg, concurrency: int, pool_size: int, sampler_for) -> dict:
    """Run one episode per task, `concurrency` at a time; warm when pool_size > 0."""
    from tmax.training.rollout import EpisodeRequest, EpisodeSettings, prepare_tasks, prewarm, run_ahead, run_episode

    episode = EpisodeSettings.of(cfg.rollout.model_copy(update={"sandbox": kind, "pool_size": pool_size}))
    settings = episode.env
    images = prepare_tasks(settings, task_dirs, log=lambda m: print(m, file=sys.stderr)).images
    pool = episode.worker_pool(concurrency)

    def one(i: int) -> dict:
        d = task_dirs[i]
        r = run_episode(EpisodeRequest(d, i, 0, i), sampler_for(d), tok, episode, image=images[d], pool=pool)
        return {"reward": r.reward, "warm": r.warm_start, "start_s": r.timings["sandbox_start_s"],
                "sampled": sum(r.trace.mask)}

    if pool is not None:
        # A learn worker's pool fills while the learner trains between steps: time from a
        # filled pool, as the episodes of a step start.
        for d in task_dirs[:concurrency]:
            prewarm(pool, d, settings, images[d])
        pool.wait_warm(timeout=300)
    t0 = time.monotonic()
    try:
        results = run_ahead(task_dirs, one, settings, images, pool, concurrency)
    finally:
        if pool is not None:
            pool.close()
    wall = time.monotonic() - t0
    n = len(results)
    return {"episodes": n, "seconds": round(wall, 2), "episodes_per_min": round(60 * n / wall, 2),
            "solved": sum(1 for r in results if r["reward"] >= 1.0), "warm_starts": sum(r["warm"] for r in results),
            "sandbox_start_mean_s": round(sum(r["start_s"] for r in results) / n, 3),
            "sampled_tokens": sum(r["sampled"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=24, help="nano tasks (one episode each) per mode")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pool", type=int, default=4, help="containers started ahead, for podman warm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a nano checkpoint to sample from (default: scripted oracle turns)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from tmax.training.config import preset
    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits

    cfg = preset("nano")
    modes = {"local": ("local", 0), "bwrap": ("bwrap", 0), "podman_cold": ("podman", 0),
             "podman_warm": ("podman", args.pool)}
    with tempfile.TemporaryDirectory(prefix="tmax-rollout-bench-") as tmp, ExitStack() as stack:
        dirs = [str(d) for d in write_splits(Path(tmp) / "tasks", args.tasks, 1, seed=args.seed)["train"]]
        if args.model:
            from tmax.training.inference.engine import VLLMEngine

            tok = AutoTokenizer.from_pretrained(args.model)
            engine = stack.enter_context(VLLMEngine.from_config(cfg.engine, args.model, Path(tmp) / "engine"))
            sampler_for = served_sampler(engine.sampler(seed_base=args.seed))
        else:
            build_tokenizer(args.seed).save_pretrained(Path(tmp) / "tok")
            tok = AutoTokenizer.from_pretrained(Path(tmp) / "tok")
            sampler_for = scripted_samplers(tok, dirs)
        res = {name: run_mode(kind, dirs, tok, cfg, args.concurrency, pool, sampler_for)
               for name, (kind, pool) in modes.items()}
    out = {f"episodes_per_min_{name}": r["episodes_per_min"] for name, r in res.items()}
    out["podman_warm_vs_local"] = round(res["podman_warm"]["episodes_per_min"] / res["local"]["episodes_per_min"], 3)
    out["podman_warm_vs_cold"] = round(res["podman_warm"]["episodes_per_min"] / res["podman_cold"]["episodes_per_min"], 3)
    out.update({"policy": "model" if args.model else "scripted", "concurrency": args.concurrency,
                "pool": args.pool, "tasks": args.tasks, "modes": res})
    record_result(args, out)
    if args.json:
        print(json.dumps(out))
        return
    for name, r in res.items():
        print(f"{name:<12} {r['episodes_per_min']:8.1f} episodes/min  ({r['episodes']} in {r['seconds']}s, "
              f"{r['solved']} solved, {r['sampled_tokens']} tokens sampled, sandbox start "
              f"{r['sandbox_start_mean_s']}s, {r['warm_starts']} warm)")
    print(f"podman warm / local: {out['podman_warm_vs_local']}   warm / cold: {out['podman_warm_vs_cold']}")


if __name__ == "__main__":
    main()
