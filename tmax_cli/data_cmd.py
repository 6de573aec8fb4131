"""`tmax data`: synthesize, import, validate and analyse Harbor task corpora.

    tmax data generate -o OUT -N N --base-url URL -m MODEL [--kind legacy|sft_v2|rl_v2] [--seed S]
    tmax data validate DIR [-e podman|bwrap|local] [-n N]
    tmax data solve DIR -a AGENT -k K [--band LO:HI --out DIR]
    tmax data import SRC -o OUT --format harbor|open-instruct|native
    tmax data report DIR [--png FILE]
    tmax data decontam DIR --against BENCH_DIR [--n 13] [--drop OUT]
    tmax data combine A B ... -o OUT --mode union|balanced [--total N]

Every command takes --json: one JSON document on stdout (progress goes to stderr).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

data_app = typer.Typer(help="Synthesize, import, validate and analyse task corpora.", no_args_is_help=True)

_JSON = typer.Option(False, "--json", help="Print one JSON document on stdout.")
_ENV = typer.Option("podman", "-e", "--env", help="Where tasks run: podman | bwrap | local.")
_AXES = typer.Option(None, "--axes", help="Axes file (TOML, the shape of tasks/data/axes.toml); default the bundled one.")


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _fail(msg: str, code: int = 2) -> None:
    _console().print(f"[red]error:[/] {msg}")
    raise typer.Exit(code)


def _emit_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def _bar(total: int, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=_console())
    return bar, bar.add_task(label, total=total, info="")


@data_app.command("generate")
def generate_cmd(
    out: Path = typer.Option(..., "-o", "--out", help="Corpus directory (created; a rerun resumes it)."),
    n: int = typer.Option(..., "-N", "--n-tasks", help="How many tasks to attempt."),
    base_url: str = typer.Option(..., "--base-url", envvar="TMAX_BASE_URL", help="OpenAI-compatible endpoint."),
    model: str = typer.Option(..., "-m", "--model", help="Model name at the endpoint."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Endpoint API key."),
    kind: str = typer.Option("legacy", "--kind", help="Corpus kind: legacy | sft_v2 | rl_v2."),
    seed: int = typer.Option(0, "--seed", help="Seed of the axis draws (same seed, same axes)."),
    concurrent: int = typer.Option(4, "-n", "--n-concurrent", help="Tasks generated at once."),
    retries: int = typer.Option(3, "--max-retries", help="Extra rounds after a failed gate or parse."),
    env: str = _ENV,
    axes: Optional[Path] = _AXES,
    as_json: bool = _JSON,
) -> None:
    """Generate tasks: template, initial test, final test, environment + solution, then the gates."""
    from tasks.corpus.axes import AxesError
    from tasks.corpus.generate import GenerateConfig, GenerateError, Generator

    try:
        cfg = GenerateConfig(out=str(out), n=n, seed=seed, corpus_kind=kind, model=model, base_url=base_url,
                             n_concurrent=concurrent, max_retries=retries, environment=env,
                             axes_file=str(axes) if axes else None)
    except ValueError as e:
        _fail(str(e))
    bar, tid = _bar(n, "generate")

    def on_event(name: str, what: str) -> None:
        if what.startswith(("kept", "rejected", "endpoint error", "infrastructure error")):
            bar.advance(tid)
            colour = "green" if what.startswith("kept") else "red"
            bar.console.print(f"[{colour}]{what:>22}[/] {name}")
        bar.update(tid, info=f"{name}: {what}")

    try:
        gen = Generator(cfg, api_key=api_key, on_event=on_event)
        with bar:
            states = gen.run()
    except (GenerateError, AxesError) as e:
        _fail(str(e))
    rows = [{"task": s.name, "status": s.status, "failed_gate": s.failed_gate, "rounds": len(s.rounds),
             "calls": s.calls} for s in states]
    summary = {"out": str(gen.out), "tasks": rows,
               "counts": {k: sum(1 for r in rows if r["status"] == k) for k in ("kept", "rejected", "pending")}}
    if as_json:
        _emit_json(summary)
    else:
        c = summary["counts"]
        _console().print(f"kept {c['kept']} · rejected {c['rejected']} · pending {c['pending']} → {gen.out}")
    if summary["counts"]["pending"]:
        _console().print("[yellow]some tasks are unfinished (endpoint or infrastructure errors): rerun the same "
                         "command to resume them[/]")
        raise typer.Exit(1)


@data_app.command("validate")
def validate_cmd(
    corpus: Path = typer.Argument(..., help="Corpus (or one task) directory."),
    env: str = _ENV,
    concurrent: int = typer.Option(2, "-n", "--n-concurrent", help="Tasks validated at once."),
    work: Optional[Path] = typer.Option(None, "--work-dir", help="Trial directories (default DIR/.tmax-validate)."),
    as_json: bool = _JSON,
) -> None:
    """Run the gates load, build, initial, nop, oracle on every task."""
    from tasks.corpus.validate import corpus_task_dirs, counts, validate_corpus
    from sandbox.base import KINDS

    if env not in KINDS:
        _fail(f"unknown environment {env!r}: {', '.join(KINDS)}")
    if not corpus.is_dir():
        _fail(f"{corpus}: no such directory")
    work = work or corpus / ".tmax-validate"
    bar, tid = _bar(len(corpus_task_dirs(corpus)), "validate")

    def on_done(r) -> None:
        colour = {"ok": "green", "unverified": "yellow"}.get(r.verdict, "red")
        infra = f"  [red](infrastructure error in {', '.join(r.infra_errors)})[/]" if r.infra_errors else ""
        bar.console.print(f"[{colour}]{r.verdict:>10}[/] {r.task}"
                          + (f"  failed: {', '.join(r.failed)}" if r.failed else "") + infra)
        bar.advance(tid)

    with bar:
        reports = validate_corpus(corpus, work, env, concurrent, on_done)
    data = {"tasks": [r.model_dump(include={"task", "verdict", "failed", "reasons"}) for r in reports],
            "counts": counts(reports)}
    if as_json:
        _emit_json(data)
    else:
        for r in reports:
            for gate, why in r.reasons.items():
                _console().print(f"[bold]{r.task}[/] {gate}: [dim]{why[:300]}[/]")
        c = data["counts"]
        _console().print(f"ok {c['ok']} · rejected {c['rejected']} · unverified {c['unverified']} (of {c['tasks']})")


@data_app.command("solve")
def solve_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    agent: str = typer.Option("oracle", "-a", "--agent", help="tmax | oracle | nop."),
    k: int = typer.Option(8, "-k", "--attempts", help="Attempts per task."),
    model: Optional[str] = typer.Option(None, "-m", "--model"),
    base_url: Optional[str] = typer.Option(None, "--base-url", envvar="TMAX_BASE_URL"),
    env: str = _ENV,
    concurrent: int = typer.Option(2, "-n", "--n-concurrent"),
    band: Optional[str] = typer.Option(None, "--band", help="Keep tasks with pass@k in LO:HI."),
    out: Optional[Path] = typer.Option(None, "--out", help="With --band: write the kept tasks here (symlinks)."),
    as_json: bool = _JSON,
) -> None:
    """Difficulty as pass@k of a bench agent; per-task summaries under DIR/.tmax-solve/."""
    from tasks.corpus.combine import write_links
    from tasks.corpus.corpus import read_corpus
    from tasks.corpus.solve import in_band, parse_band, solve_corpus
    from tasks.dataset import DatasetError
    from tasks.job import JobError

    bar, tid = _bar(0, "solve")

    def progress(kind, p, r) -> None:
        bar.update(tid, total=p.total, completed=p.done, info=f"running {p.running}")

    try:
        lo_hi = parse_band(band) if band else None
        with bar:
            summaries = solve_corpus(corpus, agent, k, model=model, base_url=base_url,
                                     api_key=os.environ.get("OPENAI_API_KEY"), environment=env,
                                     n_concurrent=concurrent, progress_fn=progress)
    except (ValueError, JobError, DatasetError) as e:
        _fail(str(e))
    kept = in_band(summaries, k, lo_hi) if lo_hi else None
    if kept is not None and out is not None:
        write_links([t for t in read_corpus(corpus) if t.name in set(kept)], out)
    data = {"tasks": {t: {"num_runs": s["num_runs"], "num_success": s["num_success"],
                          "pass_at_k": s["pass_at_k"]} for t, s in summaries.items()}, "band": kept}
    if as_json:
        _emit_json(data)
    else:
        for t, s in summaries.items():
            _console().print(f"{t}: {s['num_success']}/{s['num_runs']}  pass@{k} "
                             f"{s['pass_at_k'].get(str(k), float('nan')):.3f}")
        if kept is not None:
            _console().print(f"{len(kept)} task(s) in band {band}" + (f" → {out}" if out else ""))


@data_app.command("import")
def import_cmd(
    src: Path = typer.Argument(..., help="Directory of source tasks."),
    out: Path = typer.Option(..., "-o", "--out", help="Where the Harbor tasks go."),
    fmt: str = typer.Option(..., "--format", help="harbor | open-instruct | native."),
    as_json: bool = _JSON,
) -> None:
    """Convert a published corpus layout to Harbor tasks."""
    from tasks.corpus.importers import import_corpus

    bar, tid = _bar(0, "import")

    def on_task(name: str, error: str | None) -> None:
        bar.advance(tid)
        if error:
            bar.console.print(f"[red]skipped[/] {name}: {error}")

    try:
        with bar:
            data = import_corpus(src, out, fmt, on_task)
    except ValueError as e:
        _fail(str(e))
    if as_json:
        _emit_json(data)
    else:
        _console().print(f"imported {len(data['imported'])} task(s) to {out}; {len(data['errors'])} error(s)")
    if not data["imported"]:
        raise typer.Exit(1)


@data_app.command("report")
def report_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    png: Optional[Path] = typer.Option(None, "--png", help="Write the charts here."),
    axes: Optional[Path] = _AXES,
    as_json: bool = _JSON,
) -> None:
    """Counts per axis, balance exp(H)/N (N from the axes file), pass@k histograms."""
    from tasks.corpus.axes import AxesError, load_axes
    from tasks.corpus.corpus import CorpusError
    from tasks.corpus.report import build_report, write_png
    from tmax_cli.ui import optional_chart

    try:
        data = build_report(corpus, load_axes(axes))
    except (CorpusError, AxesError) as e:
        _fail(str(e))
    if png and optional_chart(lambda: write_png(data, png)) is None:
        png = None
    if as_json:
        _emit_json(data)
        return
    _print_report(data, png)


def _print_report(data: dict, png: Optional[Path]) -> None:
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{data['n']}[/] tasks")
    for axis, counts in data["counts"].items():
        t = Table(title=f"{axis}" + (f"  balance {data['balance'][axis]:.3f}" if axis in data["balance"] else ""),
                  title_justify="left")
        t.add_column("value")
        t.add_column("tasks", justify="right")
        for v, c in list(counts.items())[:20]:
            t.add_row(v, str(c))
        console.print(t)
    for tag, h in data["pass_at_k"].items():
        console.print(f"pass@{h['k']} histogram ({tag}): {h['counts']}")
    if png:
        console.print(f"chart: {png}")


@data_app.command("decontam")
def decontam_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    against: Path = typer.Option(..., "--against", help="Benchmark directory (its instruction.md files)."),
    n: int = typer.Option(13, "--n", help="n-gram length (words)."),
    drop: Optional[Path] = typer.Option(None, "--drop", help="Write the corpus without the hits here."),
    as_json: bool = _JSON,
) -> None:
    """Word n-gram overlap of the instructions with a benchmark's."""
    from tasks.corpus.corpus import CorpusError
    from tasks.corpus.decontam import copy_without, find_hits

    try:
        data = find_hits(corpus, against, n)
        if drop:
            data["kept"] = copy_without(corpus, drop, {h["task"] for h in data["hits"]})
    except (ValueError, CorpusError) as e:
        _fail(str(e))
    if as_json:
        _emit_json(data)
        return
    for h in data["hits"]:
        _console().print(f"[red]hit[/] {h['task']} ~ {h['benchmark_task']}: {h['shared_ngrams']} shared {n}-grams")
    n_hit = len({h['task'] for h in data['hits']})
    _console().print(f"{n_hit} of {data['checked']} task(s) overlap" + (f"; clean copy in {drop}" if drop else ""))


@data_app.command("combine")
def combine_cmd(
    corpora: list[Path] = typer.Argument(..., help="Corpus directories."),
    out: Path = typer.Option(..., "-o", "--out", help="The combined corpus (symlinks)."),
    mode: str = typer.Option("union", "--mode", help="union | balanced."),
    total: Optional[int] = typer.Option(None, "--total", help="balanced: the corpus size."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = _JSON,
) -> None:
    """Merge corpora: everything (union) or non-intricate + intricate up to --total (balanced)."""
    from tasks.corpus.combine import CombineError, select, write_links
    from tasks.corpus.corpus import CorpusError

    try:
        tasks = select(corpora, mode, total, seed)
        write_links(tasks, out)
    except (CombineError, CorpusError) as e:
        _fail(str(e))
    data = {"out": str(out), "mode": mode, "n": len(tasks), "tasks": [t.name for t in tasks]}
    if as_json:
        _emit_json(data)
    else:
        _console().print(f"{len(tasks)} task(s) → {out} ({mode})")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
