"""`tmax learn`: DPPO RL on Ray, the SFT warm start and the nano recipe.

    tmax learn                      the nano recipe's RL stage (builds / SFTs what is missing)
    tmax learn --config FILE        a run from a TOML config (`extends = "nano"` works)
    tmax learn --resume             continue the run in --out from its latest checkpoint
    tmax learn sft                  only the SFT warm start
    tmax learn nano [--json]        the whole recipe: build -> SFT -> eval -> RL -> eval
    tmax learn report RUN_DIR       a run's summary and the collapse guard's events
    tmax learn --nodes N            the same run spread over N Ray nodes (--dry-run: the plan
                                    and an sbatch script, without Ray)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

learn_app = typer.Typer(
    help="Train the agent with DPPO (RL) on Ray; `tmax learn nano` runs the whole CPU recipe.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def _config(config: Optional[Path], steps: Optional[int], seed: Optional[int], sandbox: Optional[str] = None,
            image_map: Optional[list[str]] = None):
    from training.config import PRESETS, ConfigError, load_config, preset

    over: dict = {}
    if steps is not None:
        over.setdefault("algo", {})["steps"] = steps
    if seed is not None:
        over.setdefault("algo", {})["seed"] = seed
    if sandbox is not None:  # where every episode runs: rollouts, demonstrations, held-out evals
        over.setdefault("rollout", {})["sandbox"] = sandbox
        over.setdefault("eval", {})["sandbox"] = sandbox
    if image_map:
        over.setdefault("rollout", {})["image_map"] = list(image_map)
    try:
        if config is not None and not config.exists() and str(config) in PRESETS:
            return preset(str(config), over)
        return load_config(config, over) if config else preset("nano", over)
    except ConfigError as e:
        typer.secho(str(e), fg=typer.colors.RED, err=True)
        raise typer.Exit(2)


def _out(cfg, out: Optional[Path]) -> Path:
    return (out or Path(cfg.run.out_dir)).resolve()


def _echo(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[cyan]learn[/] {msg}")


def _fail(e: Exception) -> None:
    typer.secho(f"tmax learn: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@learn_app.callback()
def learn(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="TOML run config or a preset name: nano (default), nano-podman, tmax-9b."),
    sandbox: Optional[str] = typer.Option(
        None, "--sandbox", "-e", help="Run every episode (rollouts, demos, held-out evals) in local, bwrap or podman."),
    image_map: Optional[list[str]] = typer.Option(
        None, "--image-map", help="FROM=TO base-image rewrite for building task images offline (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default: run.out_dir of the config)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run's latest checkpoint."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Override algo.steps."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override algo.seed."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar (logs only)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Spread the run over N Ray nodes (learners + engines)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node (0: a CPU-only cluster)."),
    train_nodes: Optional[int] = typer.Option(
        None, "--train-nodes", help="Nodes for learners; the rest serve (default: 2 of 8, 1 below 4 nodes)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size of each vLLM engine."),
    learners_per_node: Optional[int] = typer.Option(
        None, "--learners-per-node", help="Learner ranks per train node (default: one per GPU; 1 on CPU)."),
    engines_per_node: Optional[int] = typer.Option(
        None, "--engines-per-node", help="Engines per inference node (default: GPUs / TP; 1 on CPU)."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Ray cluster to join (default: RAY_ADDRESS, a Slurm allocation, or local)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --nodes: print the placement plan and an sbatch script."),
    from_runs: Optional[Path] = typer.Option(
        None, "--from-runs", help="Also train on rated `tmax run --tokens` sessions under DIR, as single-sample groups (A = R - 0.5)."),
    runs_per_step: int = typer.Option(1, "--runs-per-step", min=1, help="With --from-runs: rated sessions added to each step."),
) -> None:
    """Run DPPO. With no config: the nano recipe's RL stage."""
    ctx.obj = {"config": config, "out": out, "steps": steps, "seed": seed, "progress": not no_progress,
               "sandbox": sandbox, "image_map": image_map}
    if ctx.invoked_subcommand is not None:
        return
    cfg = _config(config, steps, seed, sandbox, image_map)
    rated = _rated(from_runs, runs_per_step, nodes) if from_runs is not None else None
    plan = None
    if nodes is not None:
        plan = _plan(cfg, nodes, gpus_per_node, train_nodes, tp, learners_per_node, engines_per_node)
        if tp > 1:
            cfg.engine.extra_args = [*cfg.engine.extra_args, "--tensor-parallel-size", str(tp)]
        if dry_run:
            from training.cluster.slurm import dry_run_text

            extra = [a for flag, v in (("--config", config), ("--out", out), ("--steps", steps), ("--seed", seed))
                     if v is not None for a in (flag, str(v))]
            extra += ["--tp", str(tp)] if tp > 1 else []
            extra += ["--learners-per-node", str(learners_per_node)] if learners_per_node else []
            extra += ["--engines-per-node", str(engines_per_node)] if engines_per_node else []
            typer.echo(dry_run_text(plan, extra))
            return
    elif dry_run:
        typer.secho("tmax learn: --dry-run prints a multi-node plan; pass --nodes N", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    run_dir = _out(cfg, out)
    try:
        from training.loop import train
        from training.recipe import build_stage, prepare_recipe_tasks, sft_stage

        if cfg.model.build_nano or cfg.tasks.generate_nano:
            model_dir, train_dir, held_dir = build_stage(cfg, run_dir, cfg.algo.seed, _echo)
            # Every train and held-out task's environment (image) before the first step.
            prepared = prepare_recipe_tasks(cfg, train_dir, held_dir, run_dir, _echo)
            start = sft_stage(cfg, model_dir, train_dir, run_dir, _echo)["checkpoint"]
            rl_dir = run_dir / "rl"
        else:
            if not cfg.model.path or not cfg.tasks.train:
                raise ValueError("the config needs model.path and tasks.train (or the nano build flags)")
            start, train_dir, rl_dir = cfg.model.path, cfg.tasks.train, run_dir
            prepared = prepare_recipe_tasks(cfg, train_dir, cfg.tasks.heldout, Path(rl_dir), _echo)
        if plan is None:
            res = train(cfg, start, train_dir, rl_dir, resume=resume, progress=not no_progress, prepared=prepared,
                        rated=rated)
        else:
            res = _placed_train(cfg, plan, address, start, train_dir, rl_dir, resume, not no_progress, prepared)
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        _echo("interrupted; resume with --resume")
        raise typer.Exit(130)
    except Exception as e:  # noqa: BLE001 - shown to the user, with the kind of failure
        _fail(e)
    _echo(f"done: {res.steps} steps; checkpoint {res.final_checkpoint}; reward curve {res.curve_png}")
    typer.echo(json.dumps(res.summary, indent=2))
    _guard_verdict(res.summary)


def _guard_verdict(summary: dict) -> None:
    """The collapse guard's events; a run the guard stopped exits 1."""
    from training.report import guard_report

    for line in guard_report(summary):
        _echo(line)
    if (summary.get("guard") or {}).get("stopped"):
        raise typer.Exit(1)


@learn_app.command("report")
def report(run_dir: Path = typer.Argument(..., help="A `tmax learn` run directory (with metrics.jsonl).")) -> None:
    """A run's summary from its metrics.jsonl, with the collapse guard's rollbacks and the
    signals that triggered each."""
    from training.report import guard_report, run_summary

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        metrics = run_dir / "rl" / "metrics.jsonl"  # a recipe directory
    if not metrics.is_file():
        typer.secho(f"tmax learn report: no metrics.jsonl in {run_dir} (or {run_dir / 'rl'})", fg=typer.colors.RED,
                    err=True)
        raise typer.Exit(2)
    summ = run_summary(metrics, 0.0, 0.0)
    for key in ("steps", "updates", "reward_first_quarter", "reward_last_quarter", "mask_frac_kept_mean"):
        typer.echo(f"{key}: {summ[key]}")
    for line in guard_report(summ):
        typer.echo(line)


def _rated(from_runs: Path, per_step: int, nodes: Optional[int]):
    """The rated `tmax run` sessions to add to each RL step (checked before anything starts)."""
    from training.runs_data import RatedStream, RunsDataError, load_runs

    if nodes is not None:
        typer.secho("tmax learn: --from-runs runs on one node; drop --nodes", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    try:
        return RatedStream(load_runs(from_runs), per_step=per_step)
    except (RunsDataError, ValueError) as e:
        typer.secho(f"tmax learn: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)


def _plan(cfg, nodes, gpus_per_node, train_nodes, tp, learners_per_node, engines_per_node):
    from training.cluster.placement import PlanError, make_plan

    try:
        return make_plan(nodes, gpus_per_node, train_nodes, tp=tp, sandbox_workers=cfg.run.rollout_workers,
                         learners_per_node=learners_per_node, engines_per_node=engines_per_node)
    except PlanError as e:
        typer.secho(f"tmax learn: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)


def _log_step(step: int, metrics: dict) -> None:
    """One console line per step when there is no progress bar (logs of a cluster job)."""
    keys = (("reward", "train/reward_all_rollouts"), ("batch reward", "objective/verifiable_reward"),
            ("loss tokens", "learner/tokens"), ("train s", "time/training"), ("sync s", "time/weight_sync"),
            ("episodes", "episode"), ("requeued", "infra/requeued"))
    parts = [f"{label} {metrics[k]:.4g}" for label, k in keys if isinstance(metrics.get(k), (int, float))]
    _echo(f"step {step}: " + ", ".join(parts))


def _placed_train(cfg, plan, address, start, train_dir, rl_dir, resume, progress, prepared):
    """Join (or start) the cluster, check it holds the plan, reserve the placement groups,
    train, and give everything back whatever happens."""
    from training.cluster import launch as cluster
    from training.cluster import placement
    from training.loop import train

    _echo(plan.describe(cfg.engine.weight_transport))
    handle = cluster.connect(plan, address or cfg.run.ray_address, num_cpus=cfg.run.ray_num_cpus)
    _echo(f"ray cluster: {handle.mode} ({handle.address})")
    try:
        missing = placement.check_live_cluster(plan)
        if missing:
            typer.secho("tmax learn: the Ray cluster cannot hold this plan:", fg=typer.colors.RED, err=True)
            for m in missing:
                typer.secho(f"  - {m}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1)
        pl = placement.reserve(plan)
        try:
            _echo(f"placement groups ready: learners on {pl.learner_nodes}, engines on {pl.engine_nodes}")
            res = train(cfg, start, train_dir, rl_dir, resume=resume, progress=progress, placement=pl,
                        on_step=None if progress else _log_step, prepared=prepared)
        finally:
            pl.remove()
        where = Path(rl_dir) / "placement.json"
        if where.is_file():
            _echo(f"actors placed: {where.read_text()}")
        return res
    finally:
        handle.shutdown()


@learn_app.command("sft")
def sft(
    ctx: typer.Context,
    from_runs: Optional[Path] = typer.Option(
        None, "--from-runs", help="Fine-tune on the accepted `tmax run --tokens` sessions under DIR instead (into OUT/sft-runs)."),
) -> None:
    """SFT warm start on teacher trajectories played through the harness (sft.teacher_accuracy 1 = the oracle)."""
    o = ctx.obj or {}
    cfg = _config(o.get("config"), o.get("steps"), o.get("seed"), o.get("sandbox"), o.get("image_map"))
    run_dir = _out(cfg, o.get("out"))
    if from_runs is not None:
        _sft_from_runs(cfg, from_runs, run_dir)
        return
    try:
        from training.recipe import build_stage, prepare_recipe_tasks, sft_stage

        model_dir, train_dir, _ = build_stage(cfg, run_dir, cfg.algo.seed, _echo)
        prepared = prepare_recipe_tasks(cfg, train_dir, "", run_dir, _echo)
        res = sft_stage(cfg, model_dir, prepared, run_dir, _echo)
    except Exception as e:  # noqa: BLE001
        _fail(e)
    typer.echo(json.dumps(res, indent=2))


def _sft_from_runs(cfg, runs_dir: Path, run_dir: Path) -> None:
    from dataclasses import asdict

    try:
        from training.learner.sft import sft_from_runs

        res = sft_from_runs(runs_dir, cfg, run_dir / "sft-runs", log=lambda step, total, loss: _echo(
            f"SFT step {step}/{total}: loss {loss:.3f}") if step % 20 == 0 or step == total else None)
    except Exception as e:  # noqa: BLE001
        _fail(e)
    typer.echo(json.dumps(asdict(res), indent=2))


@learn_app.command("nano")
def nano(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the results."),
) -> None:
    """The whole nano recipe: build -> SFT -> held-out eval -> DPPO -> held-out eval."""
    o = ctx.obj or {}
    cfg = _config(o.get("config"), o.get("steps"), o.get("seed"), o.get("sandbox"), o.get("image_map"))
    run_dir = _out(cfg, o.get("out"))
    try:
        from training.recipe import run_recipe

        res = run_recipe(cfg, run_dir, progress=o.get("progress", True) and not as_json, log=_echo)
    except Exception as e:  # noqa: BLE001
        _fail(e)
    if as_json:
        typer.echo(json.dumps(res))
    else:
        _echo(f"held-out pass rate: SFT {res.get('sft_pass_rate', 0):.1%} -> RL {res.get('rl_pass_rate', 0):.1%}; "
              f"{res['minutes_total']:.1f} min total; {run_dir / 'recipe.json'}")


def register(app: typer.Typer) -> None:
    app.add_typer(learn_app, name="learn")
