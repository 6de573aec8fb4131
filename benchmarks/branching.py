"""Branching rollouts (`[rollout.branching]`) against flat groups at an equal budget, on the
long-horizon nano preset (`nano-long`).

Per seed: the preset's model and tasks are built and SFT'd once (the recipe's stages), then
two RL arms start from that checkpoint, each on an engine of its own:

* flat: `--group` independent episodes per task, `--steps` steps; what it spent is the budget:
  tokens sampled and sandbox seconds (`training.branch_records.Spend`: starts, commands,
  forks, verifiers, wall seconds the sandboxes worked);
* branching: `--group / --branches` episodes per task, each forked after turn `--at-turn`
  into `--branches` continuations (as many leaves per group as flat), stepping until it has
  spent either budget (a shared stretch counted once), at most `--max-steps-factor` times
  flat's steps.

After each arm: the held-out pass rate of its last checkpoint (the recipe's eval), and
tokens the learner computed per loss token (`learner/tokens_computed` / `learner/loss_tokens`:
a prefix shared in a packed row is computed once). The SFT checkpoint's pass rate is
measured once per seed, before both. Both arms see the same tasks and the same SFT model;
the machine's other load moves their seconds, not their token counts.

    python benchmarks/branching.py [--seeds 0 1 2] [--n-train 64] [--n-heldout 32] [--sft-epochs 5]
                                   [--steps 8] [--prompts 4] [--group 8] [--branches 2] [--at-turn 2]
                                   [--env local] [--out DIR] [--json] [--record]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


class BudgetSpent(Exception):
    """Raised from the trainer's step callback once the arm has spent its budget."""


def arm_config(args, seed: int, branching: bool):
    from tmax.training.config import preset

    cfg = preset("nano-long")
    cfg.rollout.sandbox = cfg.eval.sandbox = args.env
    cfg.tasks.n_train, cfg.tasks.n_heldout = args.n_train, args.n_heldout
    cfg.sft.epochs = args.sft_epochs
    cfg.eval.attempts = args.attempts
    a = cfg.algo
    a.seed, a.prompts_per_step, a.steps = seed, args.prompts, args.steps
    a.filter_zero_std = a.active_sampling = False  # a step is the same work in both arms
    a.group_size = args.group
    cfg.run.checkpoint_every = 1  # the arm stops at any step: its last checkpoint is that step's
    if branching:
        a.group_size = max(2, args.group // args.branches)
        a.steps = args.steps * args.max_steps_factor
        cfg.rollout.branching = cfg.rollout.branching.model_copy(
            update={"enabled": True, "at_turns": [args.at_turn], "branches": args.branches})
    return cfg


def spent(run_dir: Path):
    from tmax.training.branch_records import Spend
    from tmax.training.generator import Rollout

    path = run_dir / "rollouts.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return Spend.of([Rollout.from_json(x) for x in lines])


def learner_figures(run_dir: Path) -> dict:
    from tmax.common.records import metric_values

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    computed = sum(metric_values(rows, "learner/tokens_computed"))
    loss = sum(metric_values(rows, "learner/loss_tokens"))
    return {"steps": len(rows), "tokens_computed_per_loss_token": round(computed / loss, 3) if loss else None,
            "train_reward": round(sum(metric_values(rows, "train/reward_all_rollouts")) / max(1, len(rows)), 4)}


def run_arm(cfg, out: Path, start: str, prepared, held_dir: str, budget, log, sft_eval: bool) -> dict:
    """One engine on `start`: (the SFT eval), RL until `budget` is spent (None: `algo.steps`),
    the held-out eval of the last checkpoint."""
    from tmax.training.cluster.actors import start_engines
    from tmax.training.harbor_generator import HarborGenerator
    from tmax.training.learner.checkpoint import latest_checkpoint
    from tmax.training.recipe import heldout_eval
    from tmax.training.trainer import train
    from tmax.training.weights.learner_side import load_checkpoint

    rl = out / "rl"
    engine = start_engines(cfg, start, rl)
    res: dict = {}
    try:
        if sft_eval:
            res["sft_pass"] = heldout_eval(cfg, engine, held_dir, out / "eval", "sft", log).pass_rate

        def stop_at_budget(step: int, metrics: dict) -> None:
            s = spent(rl)
            if budget is not None and (s.sampled_tokens >= budget.sampled_tokens or s.sandbox_s >= budget.sandbox_s):
                raise BudgetSpent(step)

        t0 = time.monotonic()
        try:
            train(cfg, start, HarborGenerator(cfg, prepared, rl), rl, engine_handle=engine, keep_engine=True,
                  on_step=stop_at_budget)
        except BudgetSpent:
            pass
        res["rl_s"] = round(time.monotonic() - t0, 1)
        last = latest_checkpoint(rl)
        load_checkpoint(engine, last, int(last.name.split("_")[-1]))
        res["pass"] = heldout_eval(cfg, engine, held_dir, out / "eval", "rl", log).pass_rate
    finally:
        engine.close()
        engine.kill()
    res.update(learner_figures(rl))
    res["spend"] = spent(rl).model_dump()
    return res


def one_seed(args, seed: int, root: Path, log) -> dict:
    from tmax.training.cluster.run_cluster import ray_session
    from tmax.training.recipe import build_stage, prepare_recipe_tasks, sft_stage

    flat_cfg, branch_cfg = arm_config(args, seed, False), arm_config(args, seed, True)
    base = root / f"seed{seed}"
    base.mkdir(parents=True, exist_ok=True)
    model_dir, train_dir, held_dir = build_stage(flat_cfg, base, seed, log)
    prepared = prepare_recipe_tasks(flat_cfg, train_dir, held_dir, base, log)
    t0 = time.monotonic()
    start = sft_stage(flat_cfg, model_dir, prepared, base, log).checkpoint
    out: dict = {"seed": seed, "sft_s": round(time.monotonic() - t0, 1)}
    with ray_session(flat_cfg, None, log):
        out["flat"] = run_arm(flat_cfg, base / "flat", start, prepared, held_dir, None, log, sft_eval=True)
        out["sft_pass"] = out["flat"].pop("sft_pass")
        from tmax.training.branch_records import Spend

        budget = Spend.model_validate(out["flat"]["spend"])
        out["branching"] = run_arm(branch_cfg, base / "branching", start, prepared, held_dir, budget, log,
                                   sft_eval=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-train", type=int, default=64)
    ap.add_argument("--n-heldout", type=int, default=32)
    ap.add_argument("--attempts", type=int, default=2, help="held-out trials per task")
    ap.add_argument("--sft-epochs", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=8, help="flat arm's RL steps (its spend is the budget)")
    ap.add_argument("--max-steps-factor", type=int, default=3, help="branching arm: at most this times --steps")
    ap.add_argument("--prompts", type=int, default=4, help="tasks per step")
    ap.add_argument("--group", type=int, default=8, help="scored episodes per task (branching: leaves)")
    ap.add_argument("--branches", type=int, default=2)
    ap.add_argument("--at-turn", type=int, default=2, help="branching arm: fork after this model turn")
    ap.add_argument("-e", "--env", default="local", choices=["local", "bwrap", "podman"])
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(f"branching: {msg}", file=sys.stderr, flush=True)

    tmp = None if args.out else tempfile.mkdtemp(prefix="tmax-branching-")
    root = args.out or Path(tmp)
    try:
        seeds = [one_seed(args, s, root, log) for s in args.seeds]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "json", "record", "record_dir",
                                                                            "record_benchmark")},
              "seeds": seeds, "mean": summary(seeds)}
    record_result(args, result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


def summary(seeds: list[dict]) -> dict:
    """Means over seeds: held-out pass of each arm (and SFT's), spend, computed per loss token."""
    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(sum(values) / len(values), 4) if values else None

    out = {"sft_pass": mean([s["sft_pass"] for s in seeds])}
    for arm in ("flat", "branching"):
        rows = [s[arm] for s in seeds]
        out[arm] = {"pass": mean([r["pass"] for r in rows]), "steps": mean([r["steps"] for r in rows]),
                    "sampled_tokens": mean([r["spend"]["sampled_tokens"] for r in rows]),
                    "sandbox_s": mean([r["spend"]["sandbox_s"] for r in rows]),
                    "leaves": mean([r["spend"]["leaves"] for r in rows]),
                    "tokens_computed_per_loss_token": mean([r["tokens_computed_per_loss_token"] for r in rows])}
    return out


if __name__ == "__main__":
    main()
