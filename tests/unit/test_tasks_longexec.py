"""`tasks.longexec.run_long` on a real local sandbox: a short command costs one exec and
returns its exit status and log tail at once; a long one is waited for by further execs; a
command that outlives its timeout is reported as timed out."""

from __future__ import annotations

import time

import pytest

import tmax.tasks.longexec as longexec
from tmax.sandbox import make_sandbox
from tmax.sandbox.base import SandboxSpec


class CountingSandbox:
    def __init__(self, tmp_path):
        self.box = make_sandbox("local", SandboxSpec(workdir=str(tmp_path), shell=False))
        self.box.start()
        self.execs = 0

    def exec(self, *a, **k):
        self.execs += 1
        return self.box.exec(*a, **k)


@pytest.fixture
def box(tmp_path):
    sb = CountingSandbox(tmp_path)
    yield sb
    sb.box.close()


def test_short_command_is_one_exec(box, tmp_path):
    log = tmp_path / "out.txt"
    t0 = time.monotonic()
    res = longexec.run_long(box, "echo hello; echo bye >&2; exit 3", 30, log_path=str(log), tail_bytes=100)
    assert (res.exit_code, res.timed_out) == (3, False)
    assert res.output.split() == ["hello", "bye"]
    assert box.execs == 1 and time.monotonic() - t0 < 5


def test_long_command_is_waited_for_across_execs(box, tmp_path, monkeypatch):
    monkeypatch.setattr(longexec, "WAIT_S", 1)
    res = longexec.run_long(box, "sleep 2.5; echo done", 30, log_path=str(tmp_path / "o.txt"), tail_bytes=10)
    assert (res.exit_code, res.output.strip()) == (0, "done")
    assert box.execs >= 3  # the first exec and at least two more waits


def test_timeout_is_reported(box, tmp_path):
    res = longexec.run_long(box, "sleep 30", 1, log_path=str(tmp_path / "o.txt"))
    assert res.timed_out and res.exit_code == 124
