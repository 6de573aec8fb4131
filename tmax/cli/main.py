"""The `tmax` command. Each sub-command lives in its own module, imported only when that
command runs (or help lists it), so `tmax bench` does not pay for `tmax run`'s or `tmax
serve`'s imports; heavy imports also happen inside the commands."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from tmax.cli import __version__
from tmax.cli.missing_extra import exit_if_extra_missing
from tmax.common.errors import RenamedSettingWarning

if TYPE_CHECKING:  # annotations only: the light install's typer brings its own click, not the package
    import click

# command -> the module under tmax.cli that defines it (with `register(app)`)
COMMANDS = {"run": "run_cmd", "show": "show_cmd", "serve": "serve_cmd", "sandbox": "sandbox_cmd",
            "bench": "bench_cmd", "learn": "learn_cmd", "data": "data_cmd"}


class LazyCommands(TyperGroup):
    """A group whose sub-commands are imported on first use. A command that needs an extra
    the install lacks ends with one line naming it (exit 2), not a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:
            exit_if_extra_missing(e, f"tmax {ctx.invoked_subcommand or ''}".strip())
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in COMMANDS if n not in self.commands)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            holder = typer.Typer()
            importlib.import_module(f"tmax.cli.{COMMANDS[name]}").register(holder)
            holder.callback()(lambda: None)  # keeps a one-command holder a group, so it is found by name
            group = typer.main.get_command(holder)
            assert isinstance(group, TyperGroup)
            self.add_command(group.commands[name], name)
        return super().get_command(ctx, name)


app = typer.Typer(
    name="tmax",
    cls=LazyCommands,
    help="One terminal-agent harness: run it, benchmark it, train it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tmax {__version__}")
        raise typer.Exit()


def _show_notes() -> None:
    """A setting under its old name is a one-line note on stderr, not a Python warning with
    a source line."""
    python_way = warnings.showwarning
    if getattr(python_way, "tmax_notes", False):
        return

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, RenamedSettingWarning):
            typer.echo(f"tmax: note: {message}", err=True)
        else:
            python_way(message, category, *args, **kwargs)

    setattr(show, "tmax_notes", True)
    warnings.showwarning = show


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    _show_notes()


if __name__ == "__main__":
    app()
