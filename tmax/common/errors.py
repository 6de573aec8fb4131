"""Error types shared across layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class ConfigError(ValueError):
    """A setting that is missing or invalid (a config file that does not exist, does not
    parse or does not validate, a bad flag): the message says which and where from."""


class RenamedSettingWarning(FutureWarning):
    """A setting given under its old name: it still loads, as the new one (a FutureWarning,
    so that people see it; the `tmax` command prints it as a one-line note)."""


def validation_message(e: ValidationError, what: str = "setting", known: Iterable[str] = ()) -> str:
    """A pydantic ValidationError in one line: the unknown names (of `what`s) with the
    `known` ones, else the first bad value (a validator's own message names its key itself)."""
    unknown = [str(err["loc"][-1]) for err in e.errors() if err["type"] == "extra_forbidden"]
    if unknown:
        return f"unknown {what}(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
    err = e.errors()[0]
    if err["type"] == "value_error":
        return err["msg"].removeprefix("Value error, ")
    return f"{'.'.join(str(part) for part in err['loc'])}: {err['msg']}"
