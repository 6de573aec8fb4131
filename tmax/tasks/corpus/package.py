"""Writing a synthesized task as a Harbor task directory (what `tasks.task_format.Task.load` reads).

    task.toml                     [metadata] holds the axes; [task] name and description;
                                  [agent] user = "user" (the agent is not root)
    instruction.md                what the agent sees
    environment/Dockerfile        + build-context files the generator wrote
    tests/test.sh                 runs test_final_state.py, writes reward.txt (1 or 0)
    tests/test_final_state.py     the verifier, from the privileged truth
    tests/test_initial_state.py   checks the untouched environment (the `initial` gate)
    tests/pytest_lite.py          runs the tests where pytest is not installed
    solution/solve.sh             the reference solution (the `oracle` gate)
    truth.md                      the privileged ground truth, for people; never shown to the agent

test.sh honours TMAX_WORKDIR / TMAX_LOGS_DIR so the same task runs in a podman image and
on the host sandboxes (bwrap, local).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import tomli_w

from tmax.tasks.corpus.axes import TaskAxes

LITE_RUNNER = Path(__file__).with_name("pytest_lite.py")
# The agent of a generated task is a normal user working in its home, as in the original
# corpus; the image keeps root as its USER, so the verifier can write /logs.
AGENT_USER = "user"
HOME = f"/home/{AGENT_USER}"
AGENT_TIMEOUT_S = 600.0
VERIFIER_TIMEOUT_S = 120.0

TEST_SH = """#!/bin/bash
# Verifier of a tmax data task: reward 1 when every test in test_final_state.py passes.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOGS="${TMAX_LOGS_DIR:-/logs}"
mkdir -p "$LOGS/verifier"
cd "${TMAX_WORKDIR:-$PWD}" || exit 2
export PYTHONDONTWRITEBYTECODE=1
if python3 -c "import pytest" 2>/dev/null; then
  python3 -m pytest -q -p no:cacheprovider "$HERE/test_final_state.py"
else
  python3 "$HERE/pytest_lite.py" "$HERE/test_final_state.py"
fi
if [ $? -eq 0 ]; then echo 1 > "$LOGS/verifier/reward.txt"; else echo 0 > "$LOGS/verifier/reward.txt"; fi
exit 0
"""


def run_tests_command(test_path: str) -> str:
    """The shell line that runs one pytest file with pytest or the bundled runner."""
    here = str(PurePosixPath(test_path).parent)
    return (f'export PYTHONDONTWRITEBYTECODE=1; if python3 -c "import pytest" 2>/dev/null; then '
            f'python3 -m pytest -q -p no:cacheprovider {test_path}; else python3 {here}/pytest_lite.py {test_path}; fi')


@dataclass
class TaskParts:
    name: str
    axes: TaskAxes
    instruction: str
    truth: str = ""
    initial_test: str | None = None
    final_test: str = ""
    dockerfile: str = ""
    env_files: dict[str, str] = field(default_factory=dict)  # build context, relative paths
    solution: str | None = None
    agent_user: str | None = AGENT_USER  # [agent] user; None: the image's USER


def task_toml(parts: TaskParts) -> dict:
    agent: dict = {"timeout_sec": AGENT_TIMEOUT_S}
    if parts.agent_user:
        agent["user"] = parts.agent_user
    return {
        "schema_version": "1.1",
        "task": {"name": f"tmax/{parts.name}", "description": parts.axes.scenario},
        # `source` as in the published Harbor export: legacy or v2.
        "metadata": {"source": "legacy" if parts.axes.corpus_kind == "legacy" else "v2", **parts.axes.metadata()},
        "agent": agent,
        "verifier": {"timeout_sec": VERIFIER_TIMEOUT_S},
        "environment": {"cpus": 1, "memory_mb": 2048, "allow_internet": True},
    }


def safe_relative(path: str) -> Path:
    """A build-context path from the model; absolute paths and `..` are refused."""
    p = PurePosixPath(path.strip())
    if not path.strip() or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"file path {path!r} must be relative to environment/ and stay inside it")
    return Path(*p.parts)


def write_executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    path.chmod(0o755)


def write_task(parts: TaskParts, dest: Path) -> Path:
    """Write the task to `dest` atomically (a reader never sees half a task)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{parts.name}.", dir=dest.parent))
    try:
        (tmp / "task.toml").write_text(tomli_w.dumps(task_toml(parts)))
        (tmp / "instruction.md").write_text(parts.instruction.strip() + "\n")
        if parts.truth:
            (tmp / "truth.md").write_text(parts.truth.strip() + "\n")
        env = tmp / "environment"
        env.mkdir()
        (env / "Dockerfile").write_text(parts.dockerfile.strip() + "\n")
        for rel, text in parts.env_files.items():
            target = env / safe_relative(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        tests = tmp / "tests"
        write_executable(tests / "test.sh", TEST_SH)
        (tests / "test_final_state.py").write_text(parts.final_test)
        if parts.initial_test:
            (tests / "test_initial_state.py").write_text(parts.initial_test)
        shutil.copyfile(LITE_RUNNER, tests / "pytest_lite.py")
        if parts.solution:
            write_executable(tmp / "solution" / "solve.sh", parts.solution)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def replace_dir(new: Path, dest: Path) -> None:
    """Put directory `new` at `dest`. An old `dest` is moved aside first and removed only
    once `new` is in place (moved back if that fails), so a crash never leaves neither."""
    if not dest.exists():
        os.replace(new, dest)
        return
    aside = dest.with_name(f".{dest.name}.old-{os.getpid()}-{id(new):x}")
    os.replace(dest, aside)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(aside, dest)
        raise
    shutil.rmtree(aside, ignore_errors=True)
