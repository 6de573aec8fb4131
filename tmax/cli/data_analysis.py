"""`tmax data`'s commands over a finished corpus: export, report, decontam, combine (the
generating and checking ones are in `data_cmd`, which owns the `tmax data` group)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from tmax.cli.data_group import AXES_OPTION, JSON_OPTION, stderr_console, emit_json, data_app
from tmax.cli.exits import fail

if TYPE_CHECKING:
    from tmax.tasks.corpus.balance_report import BalanceReport


@data_app.command("export")
def export_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    out: Path = typer.Option(..., "-o", "--out", help="hf: a directory; parquet: a file; tar: a .tar.gz file."),
    fmt: str = typer.Option("hf", "--format", help="hf | parquet | tar."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Write the corpus as a dataset: one row per task with every file and the metadata."""
    from tmax.tasks.corpus.corpus import CorpusError
    from tmax.tasks.corpus.export import ExportError, export_corpus

    try:
        data = export_corpus(corpus, out, fmt)
    except (ExportError, CorpusError) as e:
        fail(str(e))
    if as_json:
        emit_json(data)
    else:
        for name, why in data["unreadable"].items():
            stderr_console().print(f"[red]unreadable[/] {name}: {why} (not exported)")
        stderr_console().print(f"exported {data['exported']} task(s) to {out} ({fmt})")
    if data["unreadable"]:
        raise typer.Exit(1)


@data_app.command("report")
def report_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    png: Optional[Path] = typer.Option(None, "--png", help="Write the charts here."),
    axes: Optional[Path] = AXES_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Counts per axis, tasks lacking each axis, balance exp(H)/N over the declared buckets, success-rate histograms."""
    from tmax.tasks.corpus.axes import AxesError, load_axes
    from tmax.tasks.corpus.corpus import CorpusError
    from tmax.tasks.corpus.balance_report import build_report, write_png
    from tmax.cli.ui import optional_chart

    try:
        data = build_report(corpus, load_axes(axes))
    except (CorpusError, AxesError) as e:
        fail(str(e))
    if png and optional_chart(lambda: write_png(data, png)) is None:
        png = None
    if as_json:
        emit_json(data.model_dump(mode="json"))
        return
    _print_report(data, png)


def _print_report(data: BalanceReport, png: Optional[Path]) -> None:
    from rich.table import Table

    from tmax.tasks.corpus.balance_report import histogram_title

    console = stderr_console()
    console.print(f"[bold]{data.n}[/] tasks")
    for name, why in data.unreadable.items():
        console.print(f"[red]unreadable[/] {name}: {why}")
    for axis, counts in data.counts.items():
        title = axis
        if axis in data.balance:
            title += f"  balance {data.balance[axis]:.3f} over {data.buckets[axis]} buckets"
        if data.missing.get(axis):
            title += f"  ({data.missing[axis]} of {data.n} task(s) lack it)"
        outside = data.outside_buckets.get(axis) or {}
        if outside:
            title += f"  ({sum(outside.values())} value(s) outside the buckets, not in the balance)"
        t = Table(title=title, title_justify="left")
        t.add_column("value")
        t.add_column("tasks", justify="right")
        for v, c in list(counts.items())[:20]:
            t.add_row(v + (" [yellow](outside the buckets)[/]" if v in outside else ""), str(c))
        console.print(t)
    for axis in data.balance:
        if axis not in data.counts:
            console.print(f"{axis}: [yellow]no task has it[/] ({data.missing[axis]} of {data.n} lack it)")
    for tag, h in data.success_rate.items():
        console.print(f"{histogram_title(tag, h)}: {h.counts} over bins {h.bins}")
    if png:
        console.print(f"chart: {png}")


@data_app.command("decontam")
def decontam_cmd(
    corpus: Path = typer.Argument(..., help="Corpus directory."),
    against: Path = typer.Option(..., "--against", help="Benchmark directory (its instruction.md files)."),
    n: int = typer.Option(13, "--n", help="n-gram length (words)."),
    drop: Optional[Path] = typer.Option(None, "--drop", help="Write the corpus without the hits here."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Word n-gram overlap of the instructions with a benchmark's."""
    from tmax.tasks.corpus.corpus import CorpusError
    from tmax.tasks.corpus.decontam import copy_without, find_hits

    try:
        data = find_hits(corpus, against, n)
        if drop:
            data["kept"] = copy_without(corpus, drop, {h["task"] for h in data["hits"]})
    except (ValueError, CorpusError) as e:
        fail(str(e))
    if as_json:
        emit_json(data)
    else:
        _print_hits(data, n, drop)
    if data["unreadable"]:  # those tasks were not checked: not a clean result
        raise typer.Exit(1)


def _print_hits(data: dict, n: int, drop: Optional[Path]) -> None:
    for name, why in data["unreadable"].items():
        stderr_console().print(f"[red]unreadable[/] {name}: {why} (not checked)")
    for h in data["hits"]:
        stderr_console().print(f"[red]hit[/] {h['task']} ~ {h['benchmark_task']}: {h['shared_ngrams']} shared {n}-grams")
    n_hit = len({h['task'] for h in data['hits']})
    stderr_console().print(f"{n_hit} of {data['checked']} task(s) overlap" + (f"; clean copy in {drop}" if drop else ""))


@data_app.command("combine")
def combine_cmd(
    corpora: list[Path] = typer.Argument(..., help="Corpus directories."),
    out: Path = typer.Option(..., "-o", "--out", help="The combined corpus (symlinks)."),
    mode: str = typer.Option("union", "--mode", help="union | balanced."),
    total: Optional[int] = typer.Option(None, "--total", help="balanced: the corpus size."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Merge corpora: everything (union) or non-intricate + intricate up to --total (balanced)."""
    from tmax.tasks.corpus.combine import CombineError, select, write_links
    from tmax.tasks.corpus.corpus import CorpusError

    try:
        tasks = select(corpora, mode, total, seed)
        write_links(tasks, out)
    except (CombineError, CorpusError) as e:
        fail(str(e))
    data = {"out": str(out), "mode": mode, "n": len(tasks), "tasks": [t.name for t in tasks]}
    if as_json:
        emit_json(data)
    else:
        stderr_console().print(f"{len(tasks)} task(s) → {out} ({mode})")
