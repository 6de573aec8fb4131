"""The `tmax` command. Each sub-command lives in its own module and registers itself here;
heavy imports happen inside the commands so `tmax run` starts fast."""

from __future__ import annotations

import typer

from tmax_cli import __version__

app = typer.Typer(
    name="tmax",
    help="One terminal-agent harness: run it, benchmark it, train it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tmax {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


def _register() -> None:
    # Each module exposes `register(app)`; a module that is not there yet is skipped.
    import importlib

    for name in ("run_cmd", "show_cmd", "serve_cmd", "sandbox_cmd", "bench_cmd", "learn_cmd", "data_cmd"):
        try:
            mod = importlib.import_module(f"tmax_cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"tmax_cli.{name}":
                continue
            raise
        mod.register(app)


_register()

if __name__ == "__main__":
    app()
