"""How a command stops on bad input: one red `error:` line on stderr (never wrapped, so a
long path stays greppable; a message's [brackets] are text, not markup) and an exit status."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(msg: str, code: int = 2) -> NoReturn:
    """Print `error: MSG` as one line on stderr and exit with `code` (2: bad input)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False).print(f"[red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(code)
