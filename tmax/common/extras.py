"""The optional extras of the install (pyproject.toml) that a command can check for before
it starts any work: `require_extra("train", "training")` raises `MissingExtra` naming what
is missing and how to install it, instead of a `ModuleNotFoundError` deep inside the work.

Looking a package up (`importlib.util.find_spec`) does not import it."""

from __future__ import annotations

import importlib.util

from tmax.common.errors import MissingExtra

# The packages of each extra that tmax imports in the process that runs the command.
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("torch", "transformers", "safetensors", "ray"),
}


def missing_packages(extra: str) -> list[str]:
    """The packages of `extra` this Python cannot import."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require_extra(extra: str, what: str) -> None:
    """Raise `MissingExtra` when a package of `extra` is not installed; `what` is the work that
    needs it (the message's subject)."""
    missing = missing_packages(extra)
    if missing:
        raise MissingExtra(extra, missing, what)
