"""`tmax bench`: Harbor-format tasks (Terminal-Bench 2.0) in podman sandboxes, or on the
host sandboxes (-e bwrap|local) for tasks whose Dockerfile only adds files to the base image.

    tmax bench run PATH|DATASET -a AGENT -m MODEL --base-url URL -k N -n N -i GLOB -x GLOB -l N -e ENV
    tmax bench run --config FILE [flags]                     (the same settings in TOML, flags on top)
    tmax bench terminal-bench -m MODEL --base-url URL      (k = 5, the tasks' own timeouts)
    tmax bench resume JOB_DIR [--base-url URL] [--retry-infra] [-e ENV]
    tmax bench report JOB_DIR [--json]
    tmax bench compare JOB_DIR JOB_DIR... [--json]           (paired, with McNemar's test)
    tmax bench prepare PATH|DATASET                          (pre-build the images)

Flags follow Harbor's letters: -k is attempts (not agent settings: use --ak key=value),
-n concurrency, -i / -x include / exclude globs, -l a cap on tasks after the filters,
-e the environment (podman | bwrap | local; part of the job identity).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer

from tmax.cli.bench_settings import TERMINAL_BENCH, BenchSettings, resolve_bench
from tmax.cli.exits import fail
from tmax.cli.options import PRINT_CONFIG, FlagValues, option_parameter, setting_flags
from tmax.cli.options import print_config as print_config_lines

bench_app = typer.Typer(help="Benchmark agents on Harbor-format tasks (Terminal-Bench 2.0).", no_args_is_help=True)

EXIT_INTERRUPTED = 130


def _parse_kwargs(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            fail(f"--ak {item!r}: expected key=value")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _run_job(job, retry_infra: bool) -> None:
    """Run with a live progress line; Ctrl-C cancels cleanly and says how to resume."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    n = job.config.n_concurrent
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=False)
    tid = None

    def info(p) -> str:
        rate = f"{p.pass_rate * 100:.1f}%" if p.pass_rate is not None else "-"
        return f"running {p.running} · queued {p.queued} · mean reward {rate} · ETA {_fmt_s(p.eta_s(n))}"

    def on_event(kind: str, p, r) -> None:
        nonlocal tid
        if tid is None:
            tid = bar.add_task(job.config.job_name, total=p.total, completed=p.done, info=info(p))
        if kind == "trial_end" and r is not None:
            verdict = r.score()
            colour = "green" if verdict.passed else "yellow" if verdict.outcome == "fail" else "red"
            exc = r.exception_info.exception_message if r.exception_info else ""
            reward = "-" if verdict.reward is None else f"{verdict.reward:g}"
            bar.console.print(f"[{colour}]{verdict.outcome:>14}[/] {r.trial_name}  reward {reward}"
                              + (f"  [dim]{exc[:160]}[/]" if exc else ""))
        bar.update(tid, completed=p.done, total=p.total, info=info(p))

    console.print(f"job [bold]{job.dir}[/] · {len(job.tasks)} tasks × {job.config.n_attempts} attempts · "
                  f"agent {job.config.agent} · env {job.config.environment}" + (f" · model {job.config.model}" if job.config.model else ""))
    try:
        with bar:
            data = job.run(on_event, retry_infra=retry_infra)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted:[/] running trials were cancelled and their containers removed. "
                      f"Resume with: tmax bench resume {job.dir}")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    from tmax.tasks.scoring import Score

    _print_report(console, Score.from_dict(data.tmax_score) if data.tmax_score else None, job.dir)


def _prestart_sandboxes(environment: str | None) -> None:
    """Start what the job's sandboxes need (podman's REST service) now, so it comes up while
    the job's imports, tasks and images are loaded (most of a second on a busy machine)."""
    from tmax.sandbox import KINDS, sandbox_class

    if (environment or "podman") in KINDS:  # an unknown one is refused with the job's settings
        sandbox_class(environment or "podman").prestart()


def _make_job(s: BenchSettings):
    """The job of a command's resolved settings."""
    from pydantic import ValidationError

    from tmax.common.errors import validation_message
    from tmax.tasks.dataset import DatasetError
    from tmax.tasks.job import Job, JobSpec, JobError

    if s.dataset is None:
        fail("no tasks given: pass PATH|DATASET, or `dataset = \"...\"` in the --config file")
    name = s.job_name or datetime.now().strftime("%Y-%m-%d__%H-%M-%S")
    try:
        cfg = JobSpec(job_name=name, jobs_dir=s.jobs_dir, dataset=s.dataset, include=s.include,
                        exclude=s.exclude, limit=s.n_tasks, agent=s.agent, model=s.model,
                        base_url=s.base_url, api_key_env=s.api_key_env, agent_kwargs=s.agent_settings(),
                        n_attempts=s.n_attempts, n_concurrent=s.n_concurrent,
                        timeout_multiplier=s.timeout_multiplier, image_map=s.image_map,
                        use_prebuilt=s.prebuilt, environment=s.env, warm_ahead=s.warm_ahead, overlay=s.overlay)
        return Job(cfg, api_key=os.environ.get(s.api_key_env))
    except ValidationError as e:
        fail(validation_message(e))
    except (DatasetError, JobError, ValueError) as e:
        fail(str(e))


# The flags of a job's settings come from `BenchSettings` (`cli.bench_settings`); these are not settings.
_AK = typer.Option([], "--ak", "--agent-kwarg",
                   help="Agent setting KEY=VALUE (agents/agent_settings.py), e.g. --ak max_steps=32 (repeatable).")
_CONFIG = option_parameter("config", Optional[Path], typer.Option(
    None, "--config", "-c", help="A TOML file of these settings: the long flags' names with underscores, and "
                                 "agent settings as --ak sets them. Flags given here win over it."))


def _start(file: Optional[Path], flags: tuple[dict, dict[str, str]], ak: list[str], print_config: bool,
           defaults: dict[str, Any] | None = None, fixed: dict[str, Any] | None = None) -> None:
    """Resolve the job's settings (`fixed` over every source), then print them or run the job."""
    from tmax.common.errors import ConfigError
    from tmax.common.settings import describe

    try:
        settings, sources = resolve_bench(file, flags, _parse_kwargs(ak), defaults)
    except ConfigError as e:
        fail(str(e))
    if fixed:
        settings = settings.model_copy(update=fixed)
        sources.update({key: "the command's protocol" for key in fixed})
    if print_config:
        print_config_lines(describe(settings, sources))
        raise typer.Exit(0)
    _prestart_sandboxes(settings.env)
    _run_job(_make_job(settings), settings.retry_infra)


@bench_app.command("run")
@setting_flags(BenchSettings, "bench run", shared=[_CONFIG, PRINT_CONFIG])
def run_cmd(
    dataset: Optional[str] = typer.Argument(None, help="A task directory, a dataset directory, or name@version (local "
                                                       "cache); or `dataset` in the --config file."),
    ak: list[str] = _AK,
    *,
    config: Optional[Path],
    print_config: bool,
    flags: FlagValues,
) -> None:
    """Run an agent on tasks; results land in JOBS_DIR/JOB_NAME as each trial ends."""
    values, labels = flags.layer()
    if dataset is not None:
        values["dataset"], labels["dataset"] = dataset, "the DATASET argument"
    _start(config, (values, labels), ak, print_config)


@bench_app.command("terminal-bench")
@setting_flags(BenchSettings, "bench terminal-bench", shared=[PRINT_CONFIG], defaults=TERMINAL_BENCH)
def terminal_bench_cmd(ak: list[str] = _AK, *, print_config: bool, flags: FlagValues) -> None:
    """Terminal-Bench 2.0 by the paper's protocol: 5 attempts per task, the tasks' own timeouts,
    errors scored 0, unbiased pass@k."""
    protocol = {k: TERMINAL_BENCH[k] for k in ("n_attempts", "timeout_multiplier")}
    _start(None, flags.layer(), ak, print_config, defaults=TERMINAL_BENCH, fixed=protocol)


@bench_app.command("resume")
def resume_cmd(
    job_dir: Path = typer.Argument(..., help="The job directory."),
    base_url: Optional[str] = typer.Option(None, "--base-url", envvar="TMAX_BASE_URL",
                                           help="A new endpoint (it is not part of the job identity)."),
    concurrent: Optional[int] = typer.Option(None, "-n", "--n-concurrent", min=1),
    retry_infra: bool = typer.Option(False, "--retry-infra", help="Rerun trials that ended in an infrastructure error."),
    environment: Optional[str] = typer.Option(None, "-e", "--env",
                                              help="Only to confirm the job's environment (it is part of its "
                                                   "identity); default: the one the job was started with."),
) -> None:
    """Finish a job: run only the trials that have no result yet."""
    from tmax.tasks.dataset import DatasetError
    from tmax.tasks.job import Job, JobSpec, JobError, read_job_config

    try:
        stored = read_job_config(job_dir).tmax_job
        # The job's own settings, where tmax wrote it (Job.open says what is wrong otherwise).
        cfg = JobSpec.model_validate(stored) if stored else None
    except (JobError, ValueError):
        cfg = None
    if cfg is not None:
        _prestart_sandboxes(environment or cfg.environment)
    key = os.environ.get(cfg.api_key_env if cfg else "OPENAI_API_KEY")
    try:
        job = Job.open(job_dir, base_url=base_url, n_concurrent=concurrent, api_key=key, environment=environment)
    except (DatasetError, JobError, ValueError) as e:
        fail(str(e))
    _run_job(job, retry_infra)


def _print_report(console, sc, job_dir: Path) -> None:
    """A job's `tasks.scoring.Score` (None: no finished trial yet) as tables."""
    from rich.table import Table

    if sc is None:
        console.print("no finished trials yet")
        return
    t = Table(title=f"{job_dir.name}: per task", show_lines=False)
    for col in ("task", "category", "trials", "passed", "mean reward", "outcomes"):
        t.add_column(col, justify="right" if col in ("trials", "passed", "mean reward") else "left")
    for r in sc.tasks:
        outs = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items()))
        t.add_row(r.task, r.category, str(r.n), str(r.successes), f"{r.mean_reward * 100:.1f}%", outs)
    console.print(t)
    excl = sc.mean_reward_excl_infra
    pk = "  ".join(f"pass@{k} {v * 100:.2f}%" for k, v in sc.pass_at_k.items())
    if sc.pass_at_1_ci:
        lo, hi = sc.pass_at_1_ci
        pk += f"  (pass@1 95% CI {lo * 100:.1f}-{hi * 100:.1f}%, {sc.ci_method})"
    console.print(
        f"[bold]mean reward {sc.mean_reward * 100:.2f}%[/] over {sc.n_trials} trials / {sc.n_tasks} tasks "
        f"(errors count 0) · excluding {sc.n_infra_errors} infra errors: "
        f"{'-' if excl is None else f'{excl * 100:.2f}%'}\n{pk}\noutcomes: "
        + ", ".join(f"{k} {v}" for k, v in sorted(sc.outcomes.items())))


def _created_by_tmax(job_dir: Path) -> bool:
    from tmax.tasks.job import JobError, read_job_config

    try:
        return bool(read_job_config(job_dir).tmax_job)
    except JobError:
        return False


def _default_chart_dir(job_dir: Path) -> Path | None:
    """Charts go into a job directory tmax created; never, unasked, into another tool's."""
    return job_dir if _created_by_tmax(job_dir) else None


@bench_app.command("report")
def report_cmd(
    job_dir: Path = typer.Argument(..., help="A job directory (tmax, Harbor or another agent's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the scores as JSON."),
    chart_dir: Optional[Path] = typer.Option(None, "--chart-dir",
                                             help="Where the PNG charts go (default: the job dir when tmax "
                                                  "created it; otherwise no charts unless this is given)."),
    no_chart: bool = typer.Option(False, "--no-chart", help="Do not write PNG charts."),
) -> None:
    """Scores of a job: mean reward (errors count 0), without infra errors, pass@k, per task."""
    from rich.console import Console

    from tmax.tasks.job import JobError
    from tmax.tasks.job_dirs import load_job_results
    from tmax.tasks.scoring import TrialRow, score

    try:
        _, results = load_job_results(job_dir)
    except (JobError, OSError) as e:
        fail(str(e))
    if not results:
        fail(f"{job_dir}: no finished trials")
    sc = score([TrialRow.of(r) for r in results])
    charts = []
    out_dir = None if no_chart else (chart_dir or _default_chart_dir(job_dir))
    if out_dir is not None:
        from tmax.tasks.charts import write_charts
        from tmax.cli.ui import optional_chart

        charts = optional_chart(lambda: write_charts(sc, out_dir, title=job_dir.name)) or []
    if as_json:
        data = sc.to_dict()
        data["charts"] = [str(p) for p in charts]
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console()
    _print_report(console, sc, job_dir)
    for p in charts:
        console.print(f"chart: {p}")


def _pct(x: float, ci: tuple[float, float] | None = None) -> str:
    return f"{x * 100:.2f}%" + (f" ({ci[0] * 100:.0f}-{ci[1] * 100:.0f})" if ci else "")


def _print_comparison(console, comp) -> None:
    from rich.table import Table

    from tmax.tasks.compare import SOLVED_RULE

    ks = {j.k for j in comp.jobs}
    # pass@k only says something new when some job has more than one attempt per task.
    k_col = None if ks == {1} else (f"pass@{next(iter(ks))} (CI)" if len(ks) == 1 else "pass@k (CI)")
    # Two narrow tables rather than one wide one: both stay readable in 80 columns.
    methods = "; ".join(sorted({j.ci_method for j in comp.jobs}))
    rates = Table(title=f"per job: rates over tasks with 95% CI ({methods}); infra errors left out of the rates")
    cost = Table(title="per job: mean cost of a trial")
    for t in (rates, cost):
        t.add_column("job", overflow="fold")
    rates.add_column("agent / model", overflow="fold")
    for col in ("trials", "infra", "pass@1 (CI)", k_col):
        if col:
            rates.add_column(col, justify="right")
    for col in ("steps", "tokens", "wall s"):
        cost.add_column(col, justify="right")
    for j in comp.jobs:
        fmt = lambda v, d=0: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        at_k = [(f"k={j.k} " if len(ks) > 1 else "") + _pct(j.pass_at_k, j.pass_at_k_ci)] if k_col else []
        rates.add_row(j.name, j.agent + (f" / {j.model}" if j.model else ""), str(j.n_trials), str(j.n_infra_errors),
                      _pct(j.pass_at_1, j.pass_at_1_ci), *at_k)
        cost.add_row(j.name, fmt(j.mean_steps, 1), fmt(j.mean_tokens), fmt(j.mean_wall_s, 1))
    console.print(rates)
    console.print(cost)
    for p in comp.pairs:
        pt = Table(title=f"A = {p.a}  vs  B = {p.b}: {p.n_common_tasks} common tasks, both {p.both}, neither {p.neither}, "
                         f"McNemar exact p = {p.p_value:.4g} ({SOLVED_RULE})")
        pt.add_column(f"solved by A not B ({len(p.a_not_b)})")
        pt.add_column(f"solved by B not A ({len(p.b_not_a)})")
        for i in range(max(len(p.a_not_b), len(p.b_not_a))):
            pt.add_row(p.a_not_b[i] if i < len(p.a_not_b) else "", p.b_not_a[i] if i < len(p.b_not_a) else "")
        console.print(pt)


@bench_app.command("compare")
def compare_cmd(
    job_dirs: list[Path] = typer.Argument(..., help="Two or more job directories (tmax or Harbor) over the same tasks."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    chart: Optional[Path] = typer.Option(None, "--chart", help="PNG path (default: compare.png in the first job dir "
                                                               "when tmax created it; otherwise no chart unless "
                                                               "this is given)."),
    no_chart: bool = typer.Option(False, "--no-chart", help="Do not write the PNG."),
) -> None:
    """pass@1 / pass@k with 95% intervals per job (exact for few tasks, bootstrap for many),
    and per-task paired differences with McNemar's exact test, for jobs of any agents,
    harnesses or models (tmax or Harbor job directories)."""
    from rich.console import Console

    from tmax.tasks.compare import compare_jobs, write_compare_chart
    from tmax.tasks.job import JobError
    from tmax.cli.ui import optional_chart

    if len(job_dirs) < 2:
        fail("give at least two job directories")
    try:
        comp = compare_jobs(job_dirs)
    except (JobError, OSError) as e:
        fail(str(e))
    empty = [j.name for j in comp.jobs if not j.per_task]
    if empty:
        fail(f"no scored trials in: {', '.join(empty)}")
    default = job_dirs[0] / "compare.png" if _created_by_tmax(job_dirs[0]) else None
    target = None if no_chart else (chart or default)
    png = optional_chart(lambda: write_compare_chart(comp, target)) if target else None
    if as_json:
        typer.echo(json.dumps({**comp.to_dict(), "chart": str(png) if png else None}, indent=2))
        return
    console = Console()
    _print_comparison(console, comp)
    if png:
        console.print(f"chart: {png}")


@bench_app.command("prepare")
@setting_flags(BenchSettings, "bench prepare")
def prepare_cmd(
    dataset: str = typer.Argument(..., help="A task directory, a dataset directory, or name@version."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when a cached image exists."),
    concurrent: int = typer.Option(1, "-n", "--n-concurrent", min=1, help="Builds run at once."),
    *,
    flags: FlagValues,
) -> None:
    """Pre-build the task images (cached by content), with a progress bar."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tmax.common.errors import ConfigError
    from tmax.tasks.dataset import DatasetError, load_tasks
    from tmax.tasks.task_images import ImageBuildError, ensure_image
    from tmax.tasks.offline import default_config

    console = Console(stderr=True)
    try:
        s, _ = resolve_bench(None, flags.layer(), {})
        tasks = load_tasks(dataset, s.include or None, s.exclude or None, s.n_tasks)
        cfg = default_config(s.image_map)
    except (ConfigError, DatasetError, ValueError) as e:
        fail(str(e))
    failures = []
    with Progress(TextColumn("[bold]prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=console) as bar:
        tid = bar.add_task("images", total=len(tasks), last="")
        with ThreadPoolExecutor(max_workers=concurrent) as pool:
            futs = {pool.submit(ensure_image, t, cfg, use_prebuilt=s.prebuilt, force=force): t for t in tasks}
            for f in as_completed(futs):
                t = futs[f]
                try:
                    img = f.result()
                    msg = f"{t.name}: {img.tag}" + (f" (built in {img.build_s:.0f}s)" if img.built else " (cached)")
                    bar.console.print(f"[green]ok[/] {msg}")
                except ImageBuildError as e:
                    failures.append(t.name)
                    bar.console.print(f"[red]failed[/] {e}")
                bar.update(tid, advance=1, last=t.name)
    if failures:
        console.print(f"[red]{len(failures)} image(s) failed:[/] {', '.join(failures)}")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
