"""`tmax data`: synthesize, import, validate and analyse Harbor task corpora.

    tmax data generate -o OUT -N N --base-url URL -m MODEL [--kind legacy|sft_v2|rl_v2] [--seed S]
    tmax data validate DIR [-e podman|bwrap|local] [-n N]
    tmax data solve DIR -a AGENT -k K [--band LO:HI --out DIR]
    tmax data import SRC -o OUT --format harbor|open-instruct|native   (or SRC = hf:DIR | parquet:FILE)
    tmax data export DIR -o OUT --format hf|parquet|tar
    tmax data report DIR [--png FILE]
    tmax data decontam DIR --against BENCH_DIR [--n 13] [--drop OUT]
    tmax data combine A B ... -o OUT --mode union|balanced [--total N]

Every command takes --json: one JSON document on stdout (progress goes to stderr).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from pydantic import ValidationError

from tmax.cli.exits import fail

from tmax.cli.data_group import AXES_OPTION, JSON_OPTION, stderr_console, emit_json, data_app
from tmax.cli.options import PRINT_CONFIG, FlagValues, setting_flags
from tmax.cli.options import print_config as print_config_lines
from tmax.common.settings import describe, env_layer, flag_specs, resolve_layers
from tmax.tasks.corpus.generate_config import COMMAND as GENERATE, ENV_PREFIX as GENERATE_ENV, GenerateConfig

if TYPE_CHECKING:
    from tmax.common.records import SolveSummary

_ENV = typer.Option("podman", "-e", "--env", help="Where tasks run: podman | bwrap | local.")


def _bar(total: int, label: str):
    from tmax.cli.progress import task_jobs_bar

    return task_jobs_bar(total, label, stderr_console())


def _emit_line(data) -> None:
    """One JSON line on stdout, as soon as it is known (`--jsonl`)."""
    typer.echo(json.dumps(data, default=str))


_JSONL = typer.Option(False, "--jsonl", help="Print one JSON line per task as it finishes, then a summary line.")
_RAY = typer.Option(False, "--ray", help="Run the task jobs on a Ray cluster (--address / RAY_ADDRESS, else a "
                                         "local one).")
_ADDRESS = typer.Option(None, "--address", help="Ray cluster address (implies --ray).")
_RAY_RESOURCE = typer.Option(None, "--ray-resource", help="Only nodes advertising this Ray resource run jobs.")


_DISK = typer.Option(None, "--disk-budget-gb", help="Keep tmax's task images under this many GB: after each "
                                                    "task, the least recently used are pruned.")


def _disk_keeper(budget_gb: Optional[float], console):
    """Called after each finished job: prune task images down to the budget (podman)."""
    if budget_gb is None:
        return lambda: None
    from tmax.tasks.task_images import ImageBuildError, prune_images

    def keep() -> None:
        try:
            rep = prune_images(int(budget_gb * 1e9))
        except ImageBuildError as e:
            console.print(f"[yellow]disk budget: {e}[/]")
            return
        if rep.removed:
            console.print(f"[dim]disk budget: pruned {len(rep.removed)} least recently used image(s)[/]")

    return keep


def _backend(ray: bool, address: Optional[str], resource: Optional[str], n_concurrent: int):
    """The job runner's backend: local threads, or Ray (the trainer's cluster code)."""
    if not (ray or address):
        return None
    from tmax.cli.missing_extra import exit_if_extra_missing
    from tmax.training.cluster.corpus_backend import RayBackend

    try:
        return RayBackend(address, resource=resource)
    except Exception as e:  # cannot connect, no such resource
        exit_if_extra_missing(e, "tmax data")
        fail(f"Ray: {e}")


def _generate_config(flags: FlagValues) -> tuple[GenerateConfig, dict[str, str]]:
    """The run's settings (`TMAX_DATA_GENERATE_*` variables, then the flags) and where each
    came from; a missing or bad one is exit 2 naming its flag."""
    data, sources = resolve_layers([env_layer(GenerateConfig, GENERATE_ENV), flags.layer()])
    try:
        return GenerateConfig.model_validate(data), sources
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        spec = next((f for f in flag_specs(GenerateConfig, GENERATE) if (key,) in f.paths), None)
        what = "/".join(spec.flag.names) if spec is not None else key
        if err["type"] == "missing":
            fail(f"{what} is required")
        fail(f"{what}: {err['msg']} (from {sources.get(key, 'default')})")


@data_app.command("generate")
@setting_flags(GenerateConfig, GENERATE, shared=[PRINT_CONFIG],
               panel=f"Settings (also {GENERATE_ENV}* variables; --print-config)")
def generate_cmd(
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Endpoint API key."),
    ray: bool = _RAY,
    address: Optional[str] = _ADDRESS,
    ray_resource: Optional[str] = _RAY_RESOURCE,
    disk_budget: Optional[float] = _DISK,
    as_json: bool = JSON_OPTION,
    jsonl: bool = _JSONL,
    *,
    print_config: bool,
    flags: FlagValues,
) -> None:
    """Generate tasks: template, initial test, final test, environment + solution, then the gates."""
    from tmax.tasks.corpus.axes import AxesError
    from tmax.tasks.corpus.generate import GenerateError, Generator

    cfg, sources = _generate_config(flags)
    if print_config:
        print_config_lines(describe(cfg, sources))
        raise typer.Exit(0)
    n, concurrent = cfg.n, cfg.n_concurrent
    backend = _backend(ray, address, ray_resource, concurrent)
    bar, tid = _bar(n, "generate")
    keep_disk = _disk_keeper(disk_budget, bar.console)

    def on_slot(states, resumed: bool) -> None:
        keep_disk()
        for st in states:
            what = st.status + (f" (gate {st.failed_gate})" if st.failed_gate else "") + \
                (f": {st.pending_why}" if st.status == "pending" and st.pending_why else "")
            if jsonl:
                _emit_line({"task": st.name, "slot": st.index, "attempt": st.attempt, "status": st.status,
                            "failed_gate": st.failed_gate, "domain": st.axes.domain, "resumed": resumed})
            colour = {"kept": "green", "pending": "yellow"}.get(st.status, "red")
            bar.console.print(f"[{colour}]{what}[/] {st.name}" + ("  [dim](done before)[/]" if resumed else ""))
        if resumed:
            bar.update(tid, total=bar.tasks[0].total - 1)
        else:
            bar.advance(tid)

    try:
        gen = Generator(cfg, api_key=api_key)
        with bar:
            states = gen.run(backend, on_slot)
    except (GenerateError, AxesError) as e:
        fail(str(e))
    finally:
        if backend is not None:
            backend.close()
    rows = [{"task": s.name, "slot": s.index, "attempt": s.attempt, "domain": s.axes.domain,
             "skill_type": s.axes.skill_type, "status": s.status, "failed_gate": s.failed_gate,
             "rounds": len(s.rounds), "calls": s.calls} for s in states]
    summary = {"out": str(gen.out), "tasks": rows,
               "counts": {k: sum(1 for r in rows if r["status"] == k) for k in ("kept", "rejected", "pending")}}
    if jsonl:
        _emit_line({"counts": summary["counts"]})
    elif as_json:
        emit_json(summary)
    else:
        c = summary["counts"]
        stderr_console().print(f"kept {c['kept']} · rejected {c['rejected']} · pending {c['pending']} → {gen.out}")
    if summary["counts"]["pending"]:
        stderr_console().print("[yellow]some tasks are unfinished (endpoint or infrastructure errors): rerun the same "
                         "command to resume them[/]")
        raise typer.Exit(1)
    if not summary["counts"]["kept"]:
        stderr_console().print(f"[red]no task was kept[/]: the reasons are in {gen.out / '_rejected'}/*/rejection.json")
        raise typer.Exit(1)


@data_app.command("validate")
def validate_cmd(
    corpus: Path = typer.Argument(..., help="Corpus (or one task) directory."),
    env: str = _ENV,
    concurrent: int = typer.Option(2, "-n", "--n-concurrent", help="Tasks validated at once (local)."),
    work: Optional[Path] = typer.Option(None, "--work-dir", help="Trial directories (default DIR/.tmax-validate; "
                                        "for one task, beside it)."),
    ray: bool = _RAY,
    address: Optional[str] = _ADDRESS,
    ray_resource: Optional[str] = _RAY_RESOURCE,
    disk_budget: Optional[float] = _DISK,
    as_json: bool = JSON_OPTION,
    jsonl: bool = _JSONL,
) -> None:
    """Run the gates load, build, initial, nop, oracle on every task; a rerun resumes."""
    from tmax.sandbox.base import KINDS
    from tmax.tasks.corpus.validate import corpus_task_dirs, counts, default_work_dir, validate_corpus

    if env not in KINDS:
        fail(f"unknown environment {env!r}: {', '.join(KINDS)}")
    if not corpus.is_dir():
        fail(f"{corpus}: no such directory")
    work = work or default_work_dir(corpus)
    backend = _backend(ray, address, ray_resource, concurrent)
    bar, tid = _bar(len(corpus_task_dirs(corpus)), "validate")
    keep_disk = _disk_keeper(disk_budget, bar.console)

    def on_done(r, resumed: bool) -> None:
        keep_disk()
        if jsonl:
            _emit_line({"task": r.task, "verdict": r.verdict, "failed": r.failed, "reasons": r.reasons,
                        "infra_errors": r.infra_errors, "resumed": resumed})
        colour = {"ok": "green", "unverified": "yellow", "infra_error": "magenta"}.get(r.verdict, "red")
        infra = f"  [red](infrastructure error in {', '.join(r.infra_errors)})[/]" if r.infra_errors else ""
        bar.console.print(f"[{colour}]{r.verdict:>10}[/] {r.task}" + ("  [dim](done before)[/]" if resumed else "")
                          + (f"  failed: {', '.join(r.failed)}" if r.failed else "") + infra)
        if resumed:  # not part of this run's rate
            bar.update(tid, total=bar.tasks[0].total - 1)
        else:
            bar.advance(tid)

    try:
        with bar:
            reports = validate_corpus(corpus, work, env, concurrent, on_done, backend)
    finally:
        if backend is not None:
            backend.close()
    data = {"tasks": [r.model_dump(include={"task", "verdict", "failed", "reasons"}) for r in reports],
            "counts": counts(reports)}
    if jsonl:
        _emit_line({"counts": data["counts"]})
    elif as_json:
        emit_json(data)
    else:
        for r in reports:
            for gate, why in r.reasons.items():
                stderr_console().print(f"[bold]{r.task}[/] {gate}: [dim]{why[:300]}[/]")
        c = data["counts"]
        stderr_console().print(f"ok {c['ok']} · rejected {c['rejected']} · unverified {c['unverified']} · "
                         f"infrastructure errors {c['infra_error']} (of {c['tasks']}; a rerun retries those)")


@data_app.command("solve")
def solve_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    agent: str = typer.Option("oracle", "-a", "--agent", help="tmax | oracle | nop."),
    k: int = typer.Option(8, "-k", "--attempts", help="Attempts per task."),
    model: Optional[str] = typer.Option(None, "-m", "--model"),
    base_url: Optional[str] = typer.Option(None, "--base-url", envvar="TMAX_BASE_URL"),
    env: str = _ENV,
    concurrent: int = typer.Option(2, "-n", "--n-concurrent", help="Tasks solved at once (local)."),
    band: Optional[str] = typer.Option(None, "--band", help="Keep tasks whose success rate c/n is in LO:HI."),
    out: Optional[Path] = typer.Option(None, "--out", help="With --band: write the kept tasks here (symlinks)."),
    ray: bool = _RAY,
    address: Optional[str] = _ADDRESS,
    ray_resource: Optional[str] = _RAY_RESOURCE,
    as_json: bool = JSON_OPTION,
    jsonl: bool = _JSONL,
) -> None:
    """Difficulty as the success rate c/n (and pass@k) of a bench agent; summaries under DIR/.tmax-solve/."""
    from tmax.tasks.corpus.combine import write_links
    from tmax.tasks.corpus.corpus import read_corpus
    from tmax.tasks.corpus.solve import in_band, parse_band, solve_corpus
    from tmax.tasks.dataset import DatasetError
    from tmax.tasks.job import JobError

    try:
        lo_hi = parse_band(band) if band else None
    except ValueError as e:
        fail(str(e))
    from tmax.tasks.corpus.validate import corpus_task_dirs

    backend = _backend(ray, address, ray_resource, concurrent)
    bar, tid = _bar(len(corpus_task_dirs(corpus)) if corpus.is_dir() else 0, "solve")

    def on_task(s: SolveSummary, resumed: bool) -> None:
        if jsonl:
            _emit_line({**s.model_dump(include={"task", "num_attempts", "num_runs", "num_success", "success_rate"}),
                        "resumed": resumed})
        bar.console.print(f"{s.task}: solved {s.num_success}/{s.num_runs}"
                          + ("  [dim](done before)[/]" if resumed else ""))
        bar.advance(tid)

    try:
        with bar:
            summaries, unreadable = solve_corpus(corpus, agent, k, model=model, base_url=base_url,
                                     api_key=os.environ.get("OPENAI_API_KEY"), environment=env,
                                     n_concurrent=concurrent, backend=backend, on_task=on_task)
    except (ValueError, JobError, DatasetError) as e:
        fail(str(e))
    finally:
        if backend is not None:
            backend.close()
    kept = in_band(summaries, lo_hi) if lo_hi else None
    if kept is not None and out is not None:
        write_links([t for t in read_corpus(corpus) if t.name in set(kept)], out)
    data = {"tasks": {t: s.model_dump(include={"num_attempts", "num_runs", "num_success", "success_rate", "pass_at_k"})
                      for t, s in summaries.items()}, "band": kept, "unreadable": unreadable}
    for name, why in unreadable.items():
        stderr_console().print(f"[red]unreadable[/] {name}: {why} (not solved)")
    if jsonl:
        _emit_line({"band": kept, "unreadable": unreadable})
    elif as_json:
        emit_json(data)
    else:
        for t, s in summaries.items():
            rate = "n/a" if s.success_rate is None else f"{s.success_rate:.3f}"
            stderr_console().print(f"{t}: solved {s.num_success}/{s.num_runs} (rate {rate}; k = "
                                   f"{s.attempts} attempts, n = {s.num_runs} scored)")
        if kept is not None:
            stderr_console().print(f"{len(kept)} task(s) with a success rate in {band}" + (f" → {out}" if out else ""))
    if unreadable:  # those tasks were not solved: not a clean result
        raise typer.Exit(1)


@data_app.command("import")
def import_cmd(
    src: str = typer.Argument(..., help="Directory of source tasks, or hf:DIR / parquet:FILE of an export."),
    out: Path = typer.Option(..., "-o", "--out", help="Where the Harbor tasks go."),
    fmt: Optional[str] = typer.Option(None, "--format", help="harbor | open-instruct | native (for a directory)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Convert a published corpus layout, or a dataset made by `tmax data export`, to Harbor tasks."""
    from tmax.tasks.corpus.export import DATASET_PREFIXES, ExportError, import_dataset
    from tmax.tasks.corpus.importers import import_corpus

    bar, tid = _bar(0, "import")

    def on_task(name: str, error: str | None) -> None:
        bar.advance(tid)
        if error:
            bar.console.print(f"[red]skipped[/] {name}: {error}")

    try:
        if src.startswith(DATASET_PREFIXES):
            data = import_dataset(src, out)
        elif fmt is None:
            fail("--format is needed for a directory (harbor | open-instruct | native)")
        else:
            with bar:
                data = import_corpus(Path(src), out, fmt, on_task)
    except (ValueError, ExportError) as e:
        fail(str(e))
    if as_json:
        emit_json(data)
    else:
        for name, why in data["errors"].items():
            stderr_console().print(f"[red]skipped[/] {name}: {why}")
        stderr_console().print(f"imported {len(data['imported'])} task(s) to {out}; {len(data['errors'])} error(s)")
    if not data["imported"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    from tmax.cli import data_analysis  # noqa: F401  (its commands attach to the group)

    app.add_typer(data_app, name="data")
