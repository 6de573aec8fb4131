"""The nano recipe end to end: build -> SFT -> held-out eval -> DPPO RL -> held-out eval.

The recipe is `tmax learn nano`'s (`training.entry.recipe`). Prints the held-out pass rate
after SFT and after RL, the wall and CPU seconds of every stage, and
the trainer's step time against a bare forward/backward on the same batch (the last RL
batch, replayed on the final checkpoint). `--json` prints one JSON object with (among
others) `sft_pass_rate`, `rl_pass_rate`, `minutes_total`, `stage_seconds`, `stage_cpu_seconds`,
`trainer_overhead_ratio`.

    python benchmarks/nano_recipe.py [--out DIR] [--seed N] [--steps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def last_batch_samples(run_dir: Path, cfg) -> list:
    """The TrainSamples of the last RL step, rebuilt from rollouts.jsonl (same advantages)."""
    from tmax.training.algo.advantages import group_advantages
    from tmax.training.algo.batching import Group
    from tmax.training.learner.packing import batch_samples
    from tmax.training.rollout import Rollout

    groups: dict[int, list[Rollout]] = {}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        r = Rollout.from_json(line)
        groups.setdefault(r.group_id, []).append(r)
    full = [Group(g[0].task_id, [x.reward for x in g], g) for g in groups.values()
            if len(g) == cfg.algo.group_size and len({x.reward for x in g}) > 1]
    last = full[-cfg.algo.prompts_per_step:]
    return batch_samples(last, [group_advantages(g.rewards) for g in last])


def trainer_overhead(ckpt: str, samples: list, cfg, repeats: int = 3) -> dict:
    """Learner.train_step vs a bare forward + token-logprob loss + backward + AdamW step on
    the same samples (padded batch, no packing, no DPPO mask, no fp32 head)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tmax.training.learner.learner import Learner
    from tmax.training.trainer import learner_config

    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    learner = Learner(ckpt, learner_config(cfg))
    step_s = []
    for _ in range(repeats):
        t = time.perf_counter()
        learner.train_step(samples)
        step_s.append(time.perf_counter() - t)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.algo.lr)
    bare_s = []
    for _ in range(repeats):
        t = time.perf_counter()
        opt.zero_grad()
        for s in samples:  # one sequence at a time, like an unpacked trainer
            ids = torch.tensor([s.trace.context])
            logits = model(input_ids=ids).logits[0, len(s.trace.prompt_ids) - 1: -1]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.trace.ids)[:, None]).squeeze(-1)
            m = torch.tensor(s.trace.mask, dtype=torch.float32)
            (-(lp * m).sum() * s.advantage / max(1, sum(x.num_loss_tokens for x in samples))).backward()
        opt.step()
        bare_s.append(time.perf_counter() - t)
    step, bare = min(step_s), min(bare_s)
    return {"trainer_step_s": round(step, 3), "bare_fwd_bwd_s": round(bare, 3),
            "trainer_overhead_ratio": round(step / bare, 3), "batch_samples": len(samples),
            "batch_tokens": sum(len(s) for s in samples)}


def sync_figures(metrics: Path) -> dict:
    """Bytes each engine took per weight sync (the adapter's with LoRA, else every weight)
    and the mean seconds of a sync, from the RL run's metrics."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    sizes = sorted({r["weights/sync_bytes"] for r in rows if "weights/sync_bytes" in r})
    secs = [r["time/weight_sync"] for r in rows if "time/weight_sync" in r]
    return {"sync_bytes_per_step": sizes[0] if len(sizes) == 1 else sizes,
            "sync_s_mean": round(sum(secs) / len(secs), 4) if secs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None,
                    help="run directory (default: a new one, runs/bench-nano-recipe/<config>-seed<N>-<UTC time>)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default=None, help="TOML config (default: the nano preset)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from tmax.cli.progress import learn_progress
    from tmax.training import entry
    from tmax.training.config import resolve

    over = {"algo": {k: v for k, v in (("seed", args.seed), ("steps", args.steps)) if v is not None}}
    cfg = resolve(args.config, over)  # `tmax learn nano`'s config: the file, TMAX_LEARN_* variables, the flags
    # A new directory per run by default: the recipe refuses one an earlier run used.
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out or f"runs/bench-nano-recipe/{cfg.name}-seed{cfg.algo.seed}-{stamp}").resolve()
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    res = entry.recipe(cfg, out, progress=learn_progress(not args.json), log=log)
    ckpt = res.rl.checkpoint if res.rl else None
    # The bare comparison is of full fine-tuning: a LoRA run's trainer step is not compared.
    samples = last_batch_samples(out / "rl", cfg) if ckpt and not cfg.lora.enabled else []
    overhead = trainer_overhead(ckpt, samples, cfg) if samples else {}
    summary = {
        "seed": cfg.algo.seed,
        "sft_pass_rate": res.sft_pass_rate,
        "rl_pass_rate": res.rl_pass_rate,
        "gain_points": res.gain_points,
        "minutes_total": res.minutes_total,
        "stage_seconds": res.times,
        "stage_cpu_seconds": res.cpu_times,  # this process and every process it started
        "trainer_overhead_ratio": overhead.get("trainer_overhead_ratio"),
        "trainer_step_s": overhead.get("trainer_step_s"),
        "bare_fwd_bwd_s": overhead.get("bare_fwd_bwd_s"),
        "rl_summary": res.rl.summary.model_dump(mode="json") if res.rl else None,
        **sync_figures(out / "rl" / "metrics.jsonl"),
    }
    record_result(args, summary)
    if args.json:
        print(json.dumps(summary))
        return
    print(f"held-out pass rate after SFT: {summary['sft_pass_rate']}")
    print(f"held-out pass rate after RL:  {summary['rl_pass_rate']}  ({summary['gain_points']} points)")
    print(f"  {'stage':<16} {'wall s':>8} {'CPU s':>8}")
    for k, v in res.times.items():
        print(f"  {k:<16} {v:8.1f} {res.cpu_times.get(k, float('nan')):8.1f}")
    if samples:
        print(f"trainer step {summary['trainer_step_s']}s vs bare fwd/bwd {summary['bare_fwd_bwd_s']}s "
              f"(ratio {summary['trainer_overhead_ratio']})")
    print(f"weight sync: {summary['sync_bytes_per_step']} bytes per step, {summary['sync_s_mean']} s on average")
    print(f"total {summary['minutes_total']} min")


if __name__ == "__main__":
    main()
