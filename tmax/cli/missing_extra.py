"""The CLI side of a missing extra (`common.extras`): exit 2 with one line, `COMMAND: what is
missing; the pip command`. The `tmax` group applies it wherever an import fails
(`main.LazyCommands`); commands that catch every failure themselves ask
`exit_if_extra_missing` first, and a command whose work runs in another process (`tmax serve`)
checks with `require` before it starts."""

from __future__ import annotations

import typer

from tmax.common.extras import MissingExtra, as_missing_extra, require_module


def exit_if_extra_missing(e: BaseException, command: str) -> None:
    """Exit 2 with the one line when `e` is a missing extra; else return."""
    missing = as_missing_extra(e)
    if missing is not None:
        typer.echo(f"{command}: {missing}", err=True)
        raise typer.Exit(2)


def require(command: str, module: str) -> None:
    """Exit 2 with the one line unless `module` (of an extra) is installed."""
    try:
        require_module(module)
    except MissingExtra as e:
        exit_if_extra_missing(e, command)
