"""The command lines the documentation shows (README.md and the pages under docs/), for tests
that run them exactly as written.

A test runs a documented line through `documented(LINE, PLACEHOLDER=value, ...)`: LINE must
be a line a page shows, character for character (the test fails when the page changes), and
the argv returned is that line with its placeholders (DS, URL, MODEL, DIR, ...) filled in,
as whole words or as parts of a path or of a KEY=VALUE word. tests/unit/test_readme_commands.py finds these calls
and requires one for every line that is not marked (GPU) or (cluster)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKS = ("(GPU)", "(cluster)")


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_commands(text: str) -> list[tuple[str, str]]:
    """(command, its comment) for each line of a page's ```bash blocks; a line ending in a
    backslash continues on the next."""
    out: list[tuple[str, str]] = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            command, _, comment = line.partition("  #")
            out.append((" ".join(command.split()), comment))
    return out


def documented_lines() -> dict[str, str]:
    """Every documented command line -> its comment (the pages' lines, first page first)."""
    out: dict[str, str] = {}
    for page in pages():
        for command, comment in readme_commands(page.read_text()):
            out.setdefault(command, comment)
    return out


def _fill(word: str, fill: dict[str, str]) -> str:
    """`word` filled: whole, or each part of a path or of a KEY=VALUE pair."""
    if word in fill:
        return fill[word]
    return re.sub(r"[^/=]+", lambda part: fill.get(part[0], part[0]), word)


def documented(line: str, **fill: str) -> list[str]:
    """The argv of documented `line`, placeholders filled (`DIR=str(tmp_path)`)."""
    assert line in documented_lines(), f"no page of the docs shows the line {line!r} (as written)"
    return [_fill(word, fill) for word in shlex.split(line)]
