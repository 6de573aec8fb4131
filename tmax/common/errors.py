"""Error types shared across layers."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that is missing or invalid (a config file that does not exist, does not
    parse or does not validate, a bad flag): the message says which and where from."""
