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

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from tmax.cli.missing_extra import exit_if_extra_missing
from tmax.cli.options import PRINT_CONFIG, FlagValues, option_parameter, setting_flags
from tmax.cli.options import print_config as print_config_lines
from tmax.training.config import PRESETS, LearnConfig
from tmax.common.records import GuardSummary, LearnRunDir

if TYPE_CHECKING:
    from tmax.training.recipe import RecipeResult

learn_app = typer.Typer(
    help="Train the agent with DPPO (RL) on Ray; `tmax learn nano` runs the whole CPU recipe.",
    invoke_without_command=True,
    no_args_is_help=False,
)


# Options of `tmax learn` and of its subcommands that run something (`nano`, `sft`), accepted
# after either name; the settings' flags come from the config's declaration (`training.config`).
_SHARED = [
    option_parameter("config", Optional[Path], typer.Option(
        None, "--config", "-c", help=f"TOML run config or a preset name: {', '.join(PRESETS)} (default nano). It sets "
                                     "every default (--print-config shows them).")),
    PRINT_CONFIG,
    option_parameter("no_progress", bool, typer.Option(
        False, "--no-progress", help="No progress bar, a log line per step (the default when stderr is not a terminal).")),
]


@dataclass
class _LearnOptions:
    """The options `tmax learn` and its subcommands share; the group keeps its own in
    `ctx.obj` for a subcommand to build on."""

    config: Optional[Path]
    flags: FlagValues
    print_config: bool = False
    no_progress: bool = False

    @property
    def progress(self) -> bool:
        return not self.no_progress and sys.stderr.isatty()


def _options(ctx: typer.Context, config: Optional[Path], print_config: bool, no_progress: bool,
             flags: FlagValues) -> _LearnOptions:
    """This command's options over its group's (`tmax learn -c X nano` and `tmax learn nano -c X`)."""
    group = ctx.parent.obj if ctx.parent is not None and isinstance(ctx.parent.obj, _LearnOptions) else None
    if group is None:
        return _LearnOptions(config, flags, print_config, no_progress)
    return _LearnOptions(config or group.config, flags.over(group.flags), print_config or group.print_config,
                         no_progress or group.no_progress)


def _config(o: _LearnOptions):
    """The resolved config (preset or file, TMAX_LEARN_* variables, flags); bad input exits 2.
    With --print-config: the settings and their sources are printed, and the command ends."""
    from tmax.common.errors import ConfigError
    from tmax.common.settings import describe
    from tmax.training.config import resolve_with_sources

    flags, labels = o.flags.layer()
    try:
        cfg, sources = resolve_with_sources(o.config, flags, labels)
    except ConfigError as e:
        _bad_input(e)
    if o.print_config:
        print_config_lines(describe(cfg, sources))
        raise typer.Exit(0)
    return cfg


def _out(cfg) -> Path:
    return Path(cfg.run.out_dir).resolve()


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
@setting_flags(LearnConfig, "learn", shared=_SHARED, with_defaults=False)
def learn(
    ctx: typer.Context,
    config: Optional[Path],
    print_config: bool,
    no_progress: bool,
    flags: FlagValues,
    resume: bool = typer.Option(False, "--resume", help="Continue from the run's latest checkpoint."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="With --nodes: write the run's config and an sbatch script that runs it; print the plan."),
    from_runs: Optional[Path] = typer.Option(
        None, "--from-runs", help="Also train on rated `tmax run --tokens` sessions under DIR, as single-sample groups (A = R - 0.5)."),
    runs_per_step: int = typer.Option(1, "--runs-per-step", min=1, help="With --from-runs: rated sessions added to each step."),
) -> None:
    """Run DPPO. With no config: the nano recipe's RL stage."""
    ctx.obj = _LearnOptions(config, flags, print_config, no_progress)
    if ctx.invoked_subcommand is not None:
        return
    from tmax.cli.progress import learn_progress
    from tmax.training import entry

    o = _options(ctx, config, print_config, no_progress, flags)
    cfg = _config(o)
    run_dir = _out(cfg)
    if dry_run:
        typer.echo(_call(lambda: entry.dry_run(cfg, run_dir)))
        return
    bars = learn_progress(o.progress, _echo)
    res = _call(lambda: entry.learn(cfg, run_dir, resume=resume, progress=bars, from_runs=from_runs,
                                    runs_per_step=runs_per_step, log=_echo), run_dir)
    _echo(f"done: {res.steps} steps; checkpoint {res.final_checkpoint}; reward curve {res.curve_png}")
    typer.echo(res.summary.model_dump_json(indent=2))
    _guard_verdict(res.summary.guard)


def _guard_verdict(guard: GuardSummary) -> None:
    """The collapse guard's events (summary.json's `guard`); a run the guard stopped exits 1."""
    from tmax.training.report import guard_report

    for line in guard_report(guard):
        _echo(line)
    if guard.stopped:
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
@setting_flags(LearnConfig, "learn", shared=_SHARED, with_defaults=False)
def sft(
    ctx: typer.Context,
    config: Optional[Path],
    print_config: bool,
    no_progress: bool,
    flags: FlagValues,
    from_runs: Optional[Path] = typer.Option(
        None, "--from-runs", help="Fine-tune on the accepted `tmax run --tokens` sessions under DIR instead (into OUT/sft-runs)."),
) -> None:
    """SFT warm start on teacher trajectories played through the harness (sft.teacher_accuracy 1 = the oracle)."""
    from tmax.training import entry

    cfg = _config(_options(ctx, config, print_config, no_progress, flags))
    run_dir = _out(cfg)
    if from_runs is not None:
        res = _call(lambda: entry.sft_from_runs(cfg, from_runs, run_dir, log=_echo), run_dir)
    else:
        res = _call(lambda: entry.sft(cfg, run_dir, log=_echo), run_dir)
    typer.echo(res.model_dump_json(indent=2))


@learn_app.command("nano")
@setting_flags(LearnConfig, "learn", shared=_SHARED, with_defaults=False)
def nano(
    ctx: typer.Context,
    config: Optional[Path],
    print_config: bool,
    no_progress: bool,
    flags: FlagValues,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the results."),
) -> None:
    """The whole nano recipe: build -> SFT -> held-out eval -> DPPO -> held-out eval."""
    from tmax.cli.progress import learn_progress
    from tmax.training import entry

    o = _options(ctx, config, print_config, no_progress, flags)
    cfg = _config(o)
    run_dir = _out(cfg)
    bars = learn_progress(o.progress and not as_json, _echo)
    res = _call(lambda: entry.recipe(cfg, run_dir, progress=bars, log=_echo), run_dir)
    if as_json:
        typer.echo(res.model_dump_json())
    else:
        _echo(recipe_line(res, LearnRunDir(run_dir).recipe))


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


def register(app: typer.Typer) -> None:
    app.add_typer(learn_app, name="learn")
