"""A shell restarted on a short-lived thread (the agent runs every command on one) is a
persistent shell again, in every backend."""

from __future__ import annotations

import shutil
import threading

import pytest

from tmax.sandbox import SandboxSpec, make_sandbox
from tmax.sandbox.bwrap import available as bwrap_available


def run_on_a_thread(box, command: str):
    """Like `agents.loop.Agent._execute`: the command runs on a thread that then ends."""
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", box.run(command, timeout=20)))
    worker.start()
    worker.join()
    return out["r"]


@pytest.fixture(params=[
    "local",
    pytest.param("bwrap", marks=[pytest.mark.bwrap, pytest.mark.skipif(not bwrap_available(), reason="no bubblewrap")]),
    pytest.param("podman", marks=[pytest.mark.podman, pytest.mark.skipif(shutil.which("podman") is None, reason="no podman")]),
])
def box(request, tmp_path):
    if request.param == "podman":
        spec = SandboxSpec(image=request.getfixturevalue("base_image"), workdir="/tmp")
    else:
        spec = SandboxSpec(workdir=str(tmp_path), workspace=tmp_path)
    sb = make_sandbox(request.param, spec)
    sb.start()
    yield sb
    sb.close()


@pytest.mark.parametrize("restart", ["exit", "kill -9 $$", "exec bash"])
def test_state_sticks_after_a_restart_on_a_worker_thread(box, restart):
    r = run_on_a_thread(box, restart)
    assert "restarted" in (r.note or "")
    r = run_on_a_thread(box, "mkdir -p sub && cd sub && export A=kept")
    assert r.exit_code == 0 and r.note is None, (r.output, r.note)
    for _ in range(2):
        r = run_on_a_thread(box, "echo A=$A; basename $PWD")
        assert (r.output, r.note) == ("A=kept\nsub\n", None)


@pytest.mark.parametrize("restart", ["exit", "kill -9 $$", "exec bash"])
def test_a_restarted_shell_comes_back_as_it_was(box, restart):
    """cwd, exported variables and the options a command set survive the restart, and the note
    says what came back and what did not (it used to say that all of it was reset)."""
    r = box.run("mkdir -p /tmp/back/sub && cd /tmp/back/sub && export A='two words' && set -o pipefail"
                " && shopt -s globstar && B=plain && f() { :; }")
    assert r.exit_code == 0, r.output
    r = run_on_a_thread(box, restart)
    assert "restarted: restored cwd /tmp/back/sub; exported variables (A" in r.note
    assert "shell options (pipefail globstar)" in r.note
    assert "lost: unexported variables, functions" in r.note
    r = box.run("pwd; echo \"$A|${B:-}\"; shopt -o pipefail; shopt globstar; type -t f || echo no-f")
    assert r.output.split() == ["/tmp/back/sub", "two", "words|", "pipefail", "on", "globstar", "on", "no-f"], r.output
