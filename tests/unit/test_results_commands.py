"""The reproduce commands of docs/RESULTS.md are real lines: each, as typed with `--help`
appended, is accepted by its script or by the tmax command tree. (They take minutes to hours
on this machine, so no test runs them whole: their figures are records of such runs.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "RESULTS.md"


def reproduce_lines() -> list[str]:
    """The commands the page shows: in backticks (its tables) or indented (its code)."""
    text = RESULTS.read_text()
    ticked = re.findall(r"`((?:python|bash) benchmarks/[^`]+|tmax [^`]+)`", text)
    indented = re.findall(r"^    ((?:python|bash) benchmarks/\S.*|tmax \S.*)$", text, flags=re.M)
    return sorted(set(ticked) | set(indented))


def test_the_page_shows_reproduce_commands():
    assert len(reproduce_lines()) >= 20


@pytest.mark.parametrize("line", reproduce_lines())
def test_each_reproduce_command_parses(line):
    words = shlex.split(line)
    if words[0] == "tmax":
        from tmax.cli.main import app

        result = CliRunner().invoke(app, [*words[1:], "--help"])
        assert result.exit_code == 0, f"{line!r}: {result.output[-1500:]}"
        return
    runner = [sys.executable] if words[0] == "python" else ["bash"]
    proc = subprocess.run([*runner, *words[1:], "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{line!r}: {proc.stdout[-800:]}{proc.stderr[-800:]}"
    assert "usage" in (proc.stdout + proc.stderr).lower(), f"{line!r} printed no usage"
