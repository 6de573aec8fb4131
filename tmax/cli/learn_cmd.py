"""`tmax learn`: DPPO RL on Ray, the SFT warm start and the nano recipe.

    tmax learn                      the nano recipe's RL stage (builds / SFTs what is missing)
    tmax learn --config FILE        a run from a TOML config (`extends = "nano"` works)
    tmax learn --resume             continue the run in --out from its latest checkpoint
    tmax learn sft                  only the SFT warm start
    tmax learn nano [--json]        the whole recipe: build -> SFT -> eval -> RL -> eval
    tmax learn report RUN_DIR       a run at a glance: held-out, stage times, throughput, the
                                    reward's path, the collapse guard's events (--json)
    tmax learn --nodes N            the same run spread over N Ray nodes (--dry-run: the plan,
                                    the run's whole config and an sbatch script, without Ray)
    tmax learn --lora-rank R        train a LoRA adapter of rank R (also after `sft` and `nano`)
    tmax learn merge CKPT -o DIR    a LoRA checkpoint merged into full Hugging Face weights

This module parses flags into config settings and calls `training.entry`; the work and the
Ray cluster are there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from tmax.cli.extras import exit_if_extra_missing

if TYPE_CHECKING:
    from tmax.training.recipe import RecipeResult

LORA_RANK = typer.Option(
    None, "--lora-rank", min=0, help="Train a LoRA adapter of this rank on the frozen model (lora.rank; 0: every weight).")

learn_app = typer.Typer(
    help="Train the agent with DPPO (RL) on Ray; `tmax learn nano` runs the whole CPU recipe.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def _flag_settings(o: dict) -> dict:
    """The flags that were given, as config settings (nested like the TOML file)."""
    keys = {("algo", "steps"): "steps", ("algo", "seed"): "seed", ("rollout", "sandbox"): "sandbox",
            ("eval", "sandbox"): "sandbox", ("rollout", "image_map"): "image_map",
            ("cluster", "nodes"): "nodes", ("cluster", "gpus_per_node"): "gpus_per_node",
            ("cluster", "train_nodes"): "train_nodes", ("cluster", "tp"): "tp",
            ("cluster", "learners_per_node"): "learners_per_node",
            ("cluster", "engines_per_node"): "engines_per_node", ("cluster", "address"): "address",
            ("cluster", "sandbox_nodes"): "sandbox_nodes", ("lora", "rank"): "lora_rank"}
    over: dict = {}
    for (section, key), flag in keys.items():
        value = o.get(flag)
        if value is None or (flag == "image_map" and not value):  # not given (a repeatable flag: empty)
            continue
        over.setdefault(section, {})[key] = list(value) if flag == "image_map" else value
    return over


def _config(o: dict):
    """The resolved config (preset or file, TMAX_LEARN_* variables, flags); bad input exits 2."""
    from tmax.common.errors import ConfigError
    from tmax.training.config import resolve

    try:
        return resolve(o.get("config"), _flag_settings(o))
    except ConfigError as e:
        _bad_input(e)


def _out(cfg, out: Optional[Path]) -> Path:
    return (out or Path(cfg.run.out_dir)).resolve()


def _echo(msg: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: a log line stays one line in a log file (rich wraps at 80 columns off a terminal).
    Console(stderr=True, soft_wrap=True).print(f"[cyan]learn[/] {escape(msg)}")  # a message's [brackets] are text


def _bad_input(e: Exception) -> None:
    typer.secho(f"tmax learn: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _call(work: Callable[[], Any], run_dir: Optional[Path] = None) -> Any:
    """Run `work`; bad input or a missing extra (`pip install 'tmax[train]'`) exits 2, Ctrl-C
    130, any other failure 1, each with its message. With `run_dir`, what the libraries
    write to stderr goes to its logs/driver.log (`cli.library_logs`), whose last lines
    follow the message of a failure."""
    from contextlib import nullcontext

    from tmax.cli.library_logs import library_logs, log_tail
    from tmax.common.errors import ConfigError

    with library_logs(run_dir) if run_dir is not None else nullcontext() as log:
        try:
            return work()
        except ConfigError as e:
            _bad_input(e)
        except KeyboardInterrupt:
            _echo("interrupted; resume with --resume")
            raise typer.Exit(130)
        except Exception as e:  # noqa: BLE001 - shown to the user, with the kind of failure
            exit_if_extra_missing(e, "tmax learn")
            typer.secho(f"tmax learn: {e}", fg=typer.colors.RED, err=True)
            tail = log_tail(log) if log is not None else []
            if tail:
                typer.secho(f"last lines of {log}:", err=True)
                typer.echo("\n".join(tail), err=True)
            raise typer.Exit(1)


@learn_app.callback()
def learn(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="TOML run config or a preset name: nano (default), nano-podman, nano-lora, tmax-9b, tmax-9b-lora."),
    sandbox: Optional[str] = typer.Option(
        None, "--sandbox", "-e", help="Run every episode (rollouts, demos, held-out evals) in local, bwrap or podman."),
    image_map: Optional[list[str]] = typer.Option(
        None, "--image-map", help="FROM=TO base-image rewrite for building task images offline (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default: run.out_dir of the config)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run's latest checkpoint."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Override algo.steps."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override algo.seed."),
    no_progress: bool = typer.Option(
        False, "--no-progress", help="No progress bar, a log line per step (the default when stderr is not a terminal)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Spread the run over N Ray nodes (cluster.nodes)."),
    gpus_per_node: Optional[int] = typer.Option(
        None, "--gpus-per-node", help="GPUs per node, 0: a CPU-only cluster (cluster.gpus_per_node, default 8)."),
    train_nodes: Optional[int] = typer.Option(
        None, "--train-nodes", help="Nodes for learners; the rest serve (default: 2 of 8, 1 below 4 nodes)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size of each vLLM engine (cluster.tp)."),
    learners_per_node: Optional[int] = typer.Option(
        None, "--learners-per-node", help="Learner ranks per train node (default: one per GPU; 1 on CPU)."),
    engines_per_node: Optional[int] = typer.Option(
        None, "--engines-per-node", help="Engines per inference node (default: GPUs / TP; 1 on CPU)."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Ray cluster to join (default: RAY_ADDRESS, a Slurm allocation, or local)."),
    sandbox_nodes: Optional[int] = typer.Option(
        None, "--sandbox-nodes", help="CPU nodes beyond --nodes for the rollout workers and all their containers."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="With --nodes: write the run's config and an sbatch script that runs it; print the plan."),
    from_runs: Optional[Path] = typer.Option(
        None, "--from-runs", help="Also train on rated `tmax run --tokens` sessions under DIR, as single-sample groups (A = R - 0.5)."),
    runs_per_step: int = typer.Option(1, "--runs-per-step", min=1, help="With --from-runs: rated sessions added to each step."),
    lora_rank: Optional[int] = LORA_RANK,
) -> None:
    """Run DPPO. With no config: the nano recipe's RL stage."""
    o = dict(ctx.params)
    o["progress"] = not no_progress and sys.stderr.isatty()
    ctx.obj = o
    if ctx.invoked_subcommand is not None:
        return
    from tmax.cli.progress import learn_progress
    from tmax.training import entry

    cfg = _config(o)
    run_dir = _out(cfg, out)
    if dry_run:
        typer.echo(_call(lambda: entry.dry_run(cfg, run_dir)))
        return
    bars = learn_progress(o["progress"], _echo)
    res = _call(lambda: entry.learn(cfg, run_dir, resume=resume, progress=bars, from_runs=from_runs,
                                    runs_per_step=runs_per_step, log=_echo), run_dir)
    _echo(f"done: {res.steps} steps; checkpoint {res.final_checkpoint}; reward curve {res.curve_png}")
    typer.echo(json.dumps(res.summary, indent=2))
    _guard_verdict(res.summary)


def _guard_verdict(summary: dict) -> None:
    """The collapse guard's events; a run the guard stopped exits 1."""
    from tmax.training.report import guard_report

    for line in guard_report(summary):
        _echo(line)
    if (summary.get("guard") or {}).get("stopped"):
        raise typer.Exit(1)


@learn_app.command("report")
def report(run_dir: Path = typer.Argument(
               ..., help="A `tmax learn` run directory (with metrics.jsonl) or a `tmax learn nano` one."),
           as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object.")) -> None:
    """A run at a glance: held-out pass rates before and after RL, time per stage,
    throughput, the reward's path and the collapse guard's events (with the signals that
    triggered each)."""
    from tmax.cli.learn_report import render
    from tmax.training.run_report import RunReport

    rep = _call(lambda: RunReport.read(run_dir))
    typer.echo(rep.model_dump_json(indent=2) if as_json else "\n".join(render(rep)))


@learn_app.command("sft")
def sft(
    ctx: typer.Context,
    from_runs: Optional[Path] = typer.Option(
        None, "--from-runs", help="Fine-tune on the accepted `tmax run --tokens` sessions under DIR instead (into OUT/sft-runs)."),
    lora_rank: Optional[int] = LORA_RANK,
) -> None:
    """SFT warm start on teacher trajectories played through the harness (sft.teacher_accuracy 1 = the oracle)."""
    from tmax.training import entry

    o = _with_lora(ctx, lora_rank)
    cfg = _config(o)
    run_dir = _out(cfg, o.get("out"))
    if from_runs is not None:
        res = _call(lambda: entry.sft_from_runs(cfg, from_runs, run_dir, log=_echo), run_dir)
    else:
        res = _call(lambda: entry.sft(cfg, run_dir, log=_echo), run_dir)
    typer.echo(res.model_dump_json(indent=2))


@learn_app.command("nano")
def nano(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the results."),
    lora_rank: Optional[int] = LORA_RANK,
) -> None:
    """The whole nano recipe: build -> SFT -> held-out eval -> DPPO -> held-out eval."""
    from tmax.cli.progress import learn_progress
    from tmax.training import entry

    o = _with_lora(ctx, lora_rank)
    cfg = _config(o)
    run_dir = _out(cfg, o.get("out"))
    bars = learn_progress(o.get("progress", True) and not as_json, _echo)
    res = _call(lambda: entry.recipe(cfg, run_dir, progress=bars, log=_echo), run_dir)
    if as_json:
        typer.echo(res.model_dump_json())
    else:
        _echo(recipe_line(res, run_dir / "recipe.json"))


def recipe_line(res: RecipeResult, path: Path) -> str:
    """The closing line of `tmax learn nano`."""
    rl = (f"{res.rl_eval.pass_rate:.1%} ({res.gain_points:+.1f} points)" if res.rl_eval
          else "not evaluated (the run left no final checkpoint)")
    return f"held-out pass rate: SFT {res.sft_eval.pass_rate:.1%} -> RL {rl}; {res.minutes_total:.1f} min total; {path}"


@learn_app.command("merge")
def merge(
    checkpoint: Path = typer.Argument(..., help="A LoRA checkpoint (an adapter directory written by `tmax learn`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the merged Hugging Face model."),
) -> None:
    """Merge a LoRA checkpoint into its base model: full Hugging Face weights that serve without LoRA."""
    from tmax.training import entry

    path, base = _call(lambda: entry.merge(checkpoint, out))
    _echo(f"merged {checkpoint} into its base {base}")
    typer.echo(str(path))


def _with_lora(ctx: typer.Context, lora_rank: Optional[int]) -> dict:
    """The group's options, with a subcommand's --lora-rank (which wins) in."""
    o = dict(ctx.obj or {})
    if lora_rank is not None:
        o["lora_rank"] = lora_rank
    return o


def register(app: typer.Typer) -> None:
    app.add_typer(learn_app, name="learn")
