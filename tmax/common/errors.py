"""Error types shared across layers."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that is missing or invalid (a config file that does not exist, does not
    parse or does not validate, a bad flag): the message says which and where from."""


class MissingExtra(RuntimeError):
    """A command needs packages of an optional extra that is not installed (`tmax.common.extras`):
    the message names them and the pip command that installs them."""

    def __init__(self, extra: str, missing: list[str], what: str):
        self.extra = extra
        self.missing = missing
        super().__init__(f"{what} needs {', '.join(missing)}, not installed here: pip install 'tmax[{extra}]'")
