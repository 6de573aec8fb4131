"""Where a nano RL step goes: a few DPPO steps through the real loop, then per step the
seconds and share of the step's wall of each part, on the sampler side and the learner side.

    python benchmarks/step_profile.py [--steps N] [--sft-steps N] [--model DIR] [--replays N] [--config FILE]
                                      [--out DIR] [--json]

Sampler side (from the episodes that finished during the step, in slot-seconds divided by
`run.concurrency`, the episodes running at once): `sampling` (waiting for the engine),
`environment` (commands running in the sandbox), `sandbox_start`, `verifier`, and
`sampler_idle`, the rest of the step's wall. Learner side (from the step's metrics):
`learner_forward`, `learner_backward`, `learner_optimizer`, `weight_sync` and
`learner_idle` (waiting for the batch).

`learner_tokens_per_loss_token` is the tokens the learner's forwards computed per loss
token (each shared prefix once, `learner/tokens_computed`); `per_sample_tokens_per_loss_token`
beside it is the same for one forward per sample (`learner/tokens`, every token of every
sample), what the learner computed before prefix sharing. `learner_replay` replays the last
step's batch on the final weights both ways, alternately, in this one process:
`per_sample_s` (one row per sample) against `trie_s` (the run's learner settings).
`prefix_cache_hit_rate` is the engine's (vLLM automatic prefix caching) over the run.

The start model needs some skill for groups with mixed rewards (all-equal groups are
filtered out, and the loop samples until it has a batch): `--model` takes one (e.g. a nano
recipe's `sft/`), else the nano model is built and given the preset's SFT (256 steps), or
`--sft-steps`. 64 steps are not enough: that model answered 538 of 544 episodes with
format errors, and no group had mixed rewards.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

SAMPLER_PARTS = {"sampling": "llm_s", "environment": "exec_s", "sandbox_start": "sandbox_start_s",
                 "verifier": "verifier_s"}
LEARNER_PARTS = {"learner_forward": "time/learner_forward", "learner_backward": "time/learner_backward",
                 "learner_optimizer": "time/learner_optimizer", "weight_sync": "time/weight_sync",
                 "learner_idle": "time/getting_response"}


def step_rows(run_dir: Path, concurrency: int) -> list[dict]:
    """Per step: wall, the parts' seconds and shares, and the token ratios."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rollouts = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines() if x.strip()]
    rows, prev_total, prev_episodes = [], 0.0, 0
    for m in metrics:
        wall = m["time/total"] - prev_total
        done = rollouts[prev_episodes:int(m["episode"])]
        prev_total, prev_episodes = m["time/total"], int(m["episode"])
        seconds = {k: sum(r["timings"].get(key, 0.0) for r in done) / concurrency for k, key in SAMPLER_PARTS.items()}
        seconds["sampler_idle"] = max(0.0, wall - sum(seconds.values()))
        seconds.update({k: m.get(key, 0.0) for k, key in LEARNER_PARTS.items()})
        loss_tokens = max(1.0, m["learner/loss_tokens"])
        rows.append({
            "step": int(m["training_step"]),
            "wall_s": round(wall, 2),
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "share": {k: round(v / wall, 3) for k, v in seconds.items()},
            "episodes": len(done),
            "learner_tokens": m["learner/tokens"],
            "learner_tokens_computed": m["learner/tokens_computed"],
            "loss_tokens": m["learner/loss_tokens"],
            "learner_tokens_per_loss_token": round(m["learner/tokens_computed"] / loss_tokens, 2),
            "per_sample_tokens_per_loss_token": round(m["learner/tokens"] / loss_tokens, 2),
        })
    return rows


def learner_replay(ckpt: str, samples: list, cfg, repeats: int = 3) -> dict:
    """The same batch through one learner step per sample row and through the prefix trie,
    alternately (both from the same weights, so the machine's load hits both alike)."""
    import dataclasses

    import torch

    from tmax.training.learner.learner import Learner
    from tmax.training.trainer import learner_config

    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    base = learner_config(cfg)
    ways = {"per_sample_s": Learner(ckpt, dataclasses.replace(base, pack_length=2)),
            "trie_s": Learner(ckpt, base)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    tokens: dict[str, float] = {}
    for _ in range(repeats):
        for name, learner in ways.items():
            t = time.perf_counter()
            tokens[name] = learner.train_step(samples)["learner/tokens_computed"]
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    return {**{k: round(v, 3) for k, v in best.items()}, "speedup": round(best["per_sample_s"] / best["trie_s"], 2),
            "tokens_computed": tokens, "samples": len(samples)}


def prefix_cache_hit_rate(base_url: str) -> float | None:
    """Hit prompt tokens over queried ones, vLLM's prefix cache over the run."""
    from tmax.training.inference.engine import prefix_cache_counts

    queries, hits = prefix_cache_counts(base_url)
    return round(hits / queries, 3) if queries else None


def start_model(cfg, out: Path, args, log) -> tuple[str, str, object]:
    from tmax.training.recipe import build_stage, prepare_recipe_tasks, sft_stage

    model_dir, train_dir, held_dir = build_stage(cfg, out, cfg.algo.seed, log)
    prepared = prepare_recipe_tasks(cfg, train_dir, "", out, log)
    if args.model:
        return args.model, train_dir, prepared
    sft_cfg = cfg
    if args.sft_steps:
        demos = max(1, round(len(prepared.runnable) * cfg.sft.task_fraction))
        epochs = args.sft_steps * cfg.sft.batch_size / demos
        sft_cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"epochs": epochs})})
    return sft_stage(sft_cfg, model_dir, prepared, out, log).checkpoint, train_dir, prepared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-step-profile")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the preset's)")
    ap.add_argument("--model", default=None, help="start checkpoint (default: nano model + --sft-steps of SFT)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="TOML config (default: the nano preset)")
    ap.add_argument("--replays", type=int, default=2, help="learner replays of the last batch each way (0: none)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from benchmarks.nano_recipe import last_batch_samples
    from tmax.training.cluster.actors import start_engines
    from tmax.cli.progress import learn_progress
    from tmax.training.cluster.launch import connect
    from tmax.training.config import resolve
    from tmax.training.harbor_generator import HarborGenerator
    from tmax.training.trainer import train

    # `tmax learn`'s config: the file (default: the nano preset), TMAX_LEARN_* variables, these flags.
    cfg = resolve(args.config, {"algo": {"seed": args.seed, "steps": args.steps},
                                "run": {"checkpoint_every": args.steps}})
    out = Path(args.out).resolve() / f"seed{args.seed}"
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    start, train_dir, prepared = start_model(cfg, out, args, log)
    run_dir = out / f"rl-{int(time.time())}"
    cluster = connect(cfg.cluster)
    engine = None
    try:
        engine = start_engines(cfg, start, run_dir)
        run = train(cfg, start, HarborGenerator(cfg, prepared, run_dir), run_dir,
                    progress=learn_progress(not args.json), engine_handle=engine, keep_engine=True)
        hit_rate = prefix_cache_hit_rate(engine.info()["base_url"])
    finally:
        if engine is not None:
            engine.close()
            engine.kill()
        cluster.shutdown()
    steps = step_rows(run_dir, cfg.run.concurrency)
    samples = last_batch_samples(run_dir, cfg)
    result = {
        "steps": steps,
        "learner_tokens_per_loss_token": _mean(s["learner_tokens_per_loss_token"] for s in steps),
        "per_sample_tokens_per_loss_token": _mean(s["per_sample_tokens_per_loss_token"] for s in steps),
        "prefix_cache_hit_rate": hit_rate,
        "learner_replay": (learner_replay(run.final_checkpoint, samples, cfg, args.replays)
                           if samples and run.final_checkpoint and args.replays else None),
    }
    result["tokens_ratio_before_over_after"] = round(
        result["per_sample_tokens_per_loss_token"] / result["learner_tokens_per_loss_token"], 2)
    record_result(args, result)
    if args.json:
        print(json.dumps(result))
        return
    for s in steps:
        parts = "  ".join(f"{k} {v:.1f}s ({s['share'][k]:.0%})" for k, v in s["seconds"].items())
        print(f"step {s['step']}: wall {s['wall_s']:.1f}s  {parts}")
        print(f"  learner tokens per loss token {s['learner_tokens_per_loss_token']} "
              f"(one forward per sample: {s['per_sample_tokens_per_loss_token']})")
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))


def _mean(values) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return round(sum(vals) / len(vals), 2) if vals else float("nan")


if __name__ == "__main__":
    main()
