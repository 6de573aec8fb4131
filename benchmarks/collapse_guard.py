"""The collapse guard on the nano recipe: RL at a collapsing LR with the guard off and on,
then the preset's LR with the guard off and on over several seeds (healthy runs: the guard
must neither roll back nor cost held-out points there).

One SFT warm start (the nano preset's, built once under --out and reused by every run) and
one vLLM engine serve all RL runs; before each run the engine goes back to the SFT
weights. The off and on runs share the seed, steps and everything else but `[guard]`, and
run one after the other. After each run the held-out set is evaluated (`tmax bench`, as
the recipe does) on the weights the run ended with: its last step, or, for a run that
died, the last weights it pushed. A run that dies (the collapsed policy never fills a
batch, so the loop gives up) is reported with its error and evaluated as it was left.

    python benchmarks/collapse_guard.py [--out DIR] [--seed N] [--lr 2e-3] [--steps N]
                                        [--healthy-seeds 0,1,2,3,4,5] [--healthy-variants off,on]
                                        [--skip-collapse] [--variants off,on] [--json]

Processes side by side on one --out (other --healthy-seeds, --variants) write their own
report; each run's record is kept (collapse-{off,on}.json, healthy-{off,on}-s{seed}.json),
and a run left out of --variants / --healthy-variants is read back from it (marked
`reused`), so the guard-on runs can be redone after a detector change without redoing the
guard-off ones.

`--json` prints one object: heldout_sft, heldout_off, heldout_on, rollbacks, steps_lost,
off_error, on_events (the collapsing pair); healthy_seeds, healthy_rollbacks (guard on,
total over the seeds), healthy_steps_lost, healthy_heldout_off and healthy_heldout_on
(means), and healthy (per seed and variant: held-out, rollbacks, steps lost, final LR,
reward first/last quarter, events, load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def rl_run(cfg, name: str, start: str, train_dir: str, prepared, engine, out: Path, log) -> dict:
    """One RL stage from the SFT checkpoint on the shared engine; its summary or its error."""
    from tmax.training.harbor_generator import HarborGenerator
    from tmax.training.trainer import TrainingError, train
    from tmax.training.weights.learner_side import load_checkpoint

    import shutil

    shutil.rmtree(out / name, ignore_errors=True)  # a rerun starts afresh
    load_checkpoint(engine, start, 0)  # every run starts from the same weights
    t = time.monotonic()
    res: dict = {"name": name, "lr": cfg.algo.lr, "seed": cfg.algo.seed, "guard": cfg.guard.enabled}
    try:
        run = train(cfg, start, HarborGenerator(cfg, prepared, out / name), out / name, engine_handle=engine,
                    keep_engine=True)
        res.update(steps=run.steps, summary=run.summary.model_dump(mode="json"), error=None)
    except TrainingError as e:
        res.update(steps=None, summary=None, error=str(e))
        log(f"{name}: the run died: {e}")
    res["seconds"] = round(time.monotonic() - t, 1)
    if res["summary"] is None:
        from tmax.training.report import run_summary

        res["summary"] = run_summary(out / name / "metrics.jsonl", 0.0, res["seconds"]).model_dump(mode="json")
    g = res["summary"]["guard"]
    log(f"{name}: {res['summary']['steps']} steps, {g['rollbacks']} rollbacks, {g['steps_lost']} steps lost, "
        f"reward {res['summary']['reward_first_quarter']} -> {res['summary']['reward_last_quarter']}, "
        f"{res['seconds']:.0f}s")
    return res


def fresh_eval(base, engine, held_dir: str, out: Path, name: str, log):
    """The held-out eval of the weights the engine holds now, as job `name` under out/eval.
    A job dir left by an earlier invocation is removed first: `tmax bench` resumes a job of
    the same name and configuration, which would report the earlier weights' trials."""
    import shutil

    from tmax.training.recipe import heldout_eval

    shutil.rmtree(out / "eval" / name, ignore_errors=True)
    return heldout_eval(base, engine, held_dir, out / "eval", name, log)


def final_lr(run_dir: Path) -> float | None:
    """The learning rate of the last step a run logged (the guard's remedy shows here)."""
    from tmax.training.report import read_metrics

    path = run_dir / "metrics.jsonl"
    rows = [r for r in read_metrics(path) if isinstance(r.get("lr"), (int, float))] if path.exists() else []
    return rows[-1]["lr"] if rows else None


def collapse_pair(args, base, start, train_dir, held_dir, prepared, engine, out: Path, result: dict,
                  variants: list[str], save, log) -> None:
    """RL at the collapsing LR, guard off then on, each evaluated on the held-out set. Each
    side's record is kept (collapse-{off,on}.json); a side left out of --variants is read back
    from it (its name in `reused`), so one side can be redone after a detector change."""
    from tmax.common.files import write_json_atomic

    for name, guard in (("off", False), ("on", True)):
        record = out / f"collapse-{name}.json"
        if name not in variants:
            if record.exists():
                result.update(json.loads(record.read_text()))
                result.setdefault("reused", []).append(name)
            continue
        cfg = variant(base, lr=args.lr, guard=guard, steps=args.steps)
        run = rl_run(cfg, f"collapse-{name}", start, train_dir, prepared, engine, out, log)
        side = {f"heldout_{name}": fresh_eval(base, engine, held_dir, out, f"collapse-{name}", log).pass_rate,
                f"{name}_error": run["error"], f"{name}_steps": run["summary"]["steps"]}
        if guard:
            g = run["summary"]["guard"]
            side.update(rollbacks=g["rollbacks"], steps_lost=g["steps_lost"], on_stopped=g["stopped"],
                        on_events=g["events"])
        write_json_atomic(record, side | {"lr": args.lr})
        result.update(side)
        save()
    if "heldout_on" in result and "heldout_off" in result:
        result["gain_points"] = round(100 * (result["heldout_on"] - result["heldout_off"]), 1)


def healthy_runs(args, base, start, train_dir, held_dir, prepared, engine, out: Path, result: dict, save, log) -> None:
    """The preset's LR over `--healthy-seeds`, guard off then on per seed (same conditions),
    each evaluated on the held-out set. A variant not run now is read back from its saved
    record of an earlier invocation on the same SFT checkpoint (marked `reused`)."""
    from tmax.common.files import write_json_atomic

    seeds = [int(x) for x in args.healthy_seeds.split(",") if x.strip()]
    variants = [v for v in args.healthy_variants.split(",") if v in ("off", "on")]
    result.update(healthy_seeds=seeds, healthy=[])
    for seed in seeds:
        for name in ("off", "on"):
            record = out / f"healthy-{name}-s{seed}.json"
            if name not in variants:
                if record.exists():
                    result["healthy"].append(json.loads(record.read_text()) | {"reused": True})
                continue
            load = os.getloadavg()[0]
            run = rl_run(variant(base, seed=seed, guard=name == "on", steps=args.steps), f"healthy-{name}-s{seed}",
                         start, train_dir, prepared, engine, out, log)
            s, g = run["summary"], run["summary"]["guard"]
            held = fresh_eval(base, engine, held_dir, out, f"healthy-{name}-s{seed}", log)
            h = {"seed": seed, "guard": name, "heldout": held.pass_rate, "rollbacks": g["rollbacks"],
                 "steps_lost": g["steps_lost"], "final_lr": final_lr(out / f"healthy-{name}-s{seed}"),
                 "steps": s["steps"], "error": run["error"], "reward_first_quarter": s["reward_first_quarter"],
                 "reward_last_quarter": s["reward_last_quarter"], "events": g["events"], "seconds": run["seconds"],
                 "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1)}
            write_json_atomic(record, h)
            result["healthy"].append(h)
            healthy_totals(result)
            save()


def healthy_totals(result: dict) -> None:
    """`healthy_rollbacks` (guard on, summed over seeds), the held-out means off and on."""
    runs = result["healthy"]
    for name in ("off", "on"):
        rates = [h["heldout"] for h in runs if h["guard"] == name]
        result[f"healthy_heldout_{name}"] = round(sum(rates) / len(rates), 4) if rates else None
    on = [h for h in runs if h["guard"] == "on"]
    result["healthy_rollbacks"] = sum(h["rollbacks"] for h in on)
    result["healthy_steps_lost"] = sum(h["steps_lost"] for h in on)


def variant(base, *, lr: float | None = None, seed: int | None = None, guard: bool, steps: int | None):
    cfg = base.model_copy(deep=True)
    if lr is not None:
        cfg.algo.lr = lr
    if seed is not None:
        cfg.algo.seed = seed
    if steps is not None:
        cfg.algo.steps = steps
    cfg.guard.enabled = guard
    return cfg


def report_name(args, variants: list[str]) -> str:
    """collapse_guard.json for the default runs; otherwise named after what this process
    runs, so that processes side by side on one SFT checkpoint write apart."""
    parts = ["collapse_guard"]
    if args.skip_collapse:
        parts.append("healthy")
    elif variants != ["off", "on"]:
        parts.append("_".join(variants))
    if args.healthy_variants != "off,on":
        parts.append("healthy-" + args.healthy_variants.replace(",", "_"))
    if args.healthy_seeds != "0,1,2,3,4,5":
        parts.append("s" + args.healthy_seeds.replace(",", "_"))
    return "_".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-collapse-guard")
    ap.add_argument("--seed", type=int, default=0, help="recipe seed (model, tasks, SFT) and RL seed of the pair")
    ap.add_argument("--lr", type=float, default=2e-3, help="the collapsing RL learning rate")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    ap.add_argument("--healthy-seeds", default="0,1,2,3,4,5", help="RL seeds of the preset-LR runs")
    ap.add_argument("--healthy-variants", default="off,on",
                    help="which of each healthy seed's runs (guard off, on) to run now; the others are read back")
    ap.add_argument("--skip-collapse", action="store_true", help="only the healthy runs")
    ap.add_argument("--variants", default="off,on", help="which runs of the pair (one per process: run them side by side)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from tmax.common.files import write_json_atomic
    from tmax.training.cluster.actors import start_engines
    from tmax.training.cluster.launch import connect
    from tmax.training.config import preset
    from tmax.training.recipe import build_stage, prepare_recipe_tasks, sft_stage

    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    base = preset("nano", {"algo": {"seed": args.seed}})
    # A rollback goes back to the newest checkpoint marked healthy: keep them close.
    base.run.checkpoint_every = 2
    out = Path(args.out).resolve() / f"seed{args.seed}"
    t0 = time.monotonic()
    model_dir, train_dir, held_dir = build_stage(base, out, args.seed, log)
    prepared = prepare_recipe_tasks(base, train_dir, held_dir, out, log)
    start = sft_stage(base, model_dir, prepared, out, log).checkpoint
    result: dict = {"seed": args.seed, "lr": args.lr}
    # Written after every run, so an interrupted benchmark keeps what it measured; the pair
    # and the healthy runs can run as two processes on one SFT checkpoint.
    variants = [v for v in args.variants.split(",") if v in ("off", "on")]
    report = out / f"{report_name(args, variants)}.json"

    def save() -> None:
        result["minutes_total"] = round((time.monotonic() - t0) / 60, 1)
        write_json_atomic(report, result)

    cluster = connect(base.cluster)
    engine = start_engines(base, start, out / f"engine-{report.stem}")
    try:
        if len(variants) == 2:  # a split pair (one process per side) skips the SFT eval
            result["heldout_sft"] = fresh_eval(base, engine, held_dir, out, f"sft-{report.stem}", log).pass_rate
        if not args.skip_collapse:
            collapse_pair(args, base, start, train_dir, held_dir, prepared, engine, out, result, variants, save, log)
        healthy_runs(args, base, start, train_dir, held_dir, prepared, engine, out, result, save, log)
    finally:
        engine.close()
        engine.kill()
        cluster.shutdown()
    save()
    record_result(args, result)
    if args.json:
        print(json.dumps(result))
        return
    if "gain_points" in result:
        sft = f"held-out after SFT {result['heldout_sft']:.1%}; " if "heldout_sft" in result else ""
        print(f"{sft}RL at LR {args.lr:g}: guard off "
              f"{result['heldout_off']:.1%}, guard on {result['heldout_on']:.1%} ({result['gain_points']:+.1f} points); "
              f"{result['rollbacks']} rollbacks, {result['steps_lost']} steps lost")
    for h in result["healthy"]:
        print(f"healthy seed {h['seed']}, guard {h['guard']}: held-out {h['heldout']:.1%}, {h['rollbacks']} "
              f"rollbacks, {h['steps_lost']} steps lost, final LR {h['final_lr']}, reward "
              f"{h['reward_first_quarter']} -> {h['reward_last_quarter']}" + (" (reused)" if h.get("reused") else ""))
    if result["healthy"]:
        print(f"healthy seeds {result['healthy_seeds']}: held-out off {result['healthy_heldout_off']}, on "
              f"{result['healthy_heldout_on']}; {result['healthy_rollbacks']} rollbacks with the guard on")
    print(f"total {result['minutes_total']} min")


if __name__ == "__main__":
    main()
