"""The `tmax data` command group and what its commands share: the --json and --axes options,
the stderr console, one JSON document on stdout. `data_cmd` (generate, validate, solve,
import) and `data_analysis` (export, report, decontam, combine) attach their commands to it."""

from __future__ import annotations

import json

import typer

data_app = typer.Typer(help="Synthesize, import, validate and analyse task corpora.", no_args_is_help=True)

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout.")
AXES_OPTION = typer.Option(None, "--axes", help="Axes file (TOML, the shape of tasks/data/axes.toml); default the bundled one.")


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def emit_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))
