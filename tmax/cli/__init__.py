"""The `tmax` command line: typer commands and the rich / prompt-toolkit UI."""

from tmax import __version__

__all__ = ["__version__"]
