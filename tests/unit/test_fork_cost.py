"""benchmarks/fork_cost.py's prefixes: the real task's solution split into its commands (a
heredoc kept whole), the ones that change the environment picked, cycled to each depth."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fork_cost  # noqa: E402

pytestmark = pytest.mark.skipif(not fork_cost.TASK.is_dir(), reason="needs ../shared/tb2-sample")


def test_the_depth_four_prefix_builds_and_generates_data():
    work = fork_cost.work_commands(fork_cost.TASK)
    assert [c.split()[0] for c in work] == ["echo", "cobc", "cat", "python"]
    assert work[2].startswith("cat > program.py << 'EOF'\n") and work[2].endswith("\nEOF")  # one command, whole
    assert fork_cost.prefix(work, 4) == work
    assert fork_cost.prefix(work, 1) == work[:1]
    assert fork_cost.prefix(work, 16) == work * 4


def test_the_solution_splits_into_its_top_level_commands():
    commands = fork_cost.solution_commands(fork_cost.TASK)
    assert len(commands) == 21  # solve.sh's 21 commands, its comments and blank lines left out
    assert commands[4].startswith("apt-get")  # the network's: not in the work
    assert sum("\nEOF" in c for c in commands) == 1
