"""The local backend, the factory and the pool, on the host."""

from __future__ import annotations

import threading
import time

import pytest

from tmax.sandbox import KINDS, SandboxError, SandboxSpec, make_sandbox
from tmax.sandbox.base import Sandbox
from tmax.sandbox.pool import SpecPool


@pytest.fixture
def local(tmp_path):
    sb = make_sandbox("local", SandboxSpec(workdir=str(tmp_path), env={"TMAX_T": "v"}))
    sb.start()
    yield sb
    sb.close()


def test_factory_kinds_and_errors():
    assert KINDS == ("local", "bwrap", "podman")
    for kind in KINDS:
        assert isinstance(make_sandbox(kind, SandboxSpec()), Sandbox)
    with pytest.raises(ValueError, match="unknown sandbox kind 'docker'"):
        make_sandbox("docker", SandboxSpec())


def test_run_in_workdir_with_env(local, tmp_path):
    r = local.run("pwd; echo $TMAX_T")
    assert r.output == f"{tmp_path}\nv\n"


def test_missing_workdir_is_a_sandbox_error(tmp_path):
    sb = make_sandbox("local", SandboxSpec(workdir=str(tmp_path / "nope")))
    with pytest.raises(SandboxError, match="not a directory"):
        sb.start()


def test_exec_separates_streams_and_times_out(local, tmp_path):
    local.run("cd /; export ONLY_SHELL=1")
    r = local.exec(["bash", "-c", "pwd; echo ${ONLY_SHELL:-none}; echo err >&2; exit 3"])
    assert r.output == f"{tmp_path}\nnone\n" and r.stderr == "err\n" and r.exit_code == 3
    t0 = time.monotonic()
    r = local.exec(["sleep", "30"], timeout=0.5)
    assert r.timed_out and r.exit_code == 124 and time.monotonic() - t0 < 5
    assert local.exec(["pwd"], workdir="/").output == "/\n"
    assert local.exec(["bash", "-c", "echo $X"], env={"X": "y"}).output == "y\n"


def test_copy_in_and_out(local, tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("hello")
    local.copy_in(src, "copied")
    assert local.run("cat copied/d/f.txt").output == "hello"
    local.run("echo out > made.txt")
    local.copy_out("made.txt", tmp_path / "back" / "m.txt")
    assert (tmp_path / "back" / "m.txt").read_text() == "out\n"
    with pytest.raises(SandboxError, match="does not exist"):
        local.copy_out("absent", tmp_path / "x")


def test_interrupt_through_sandbox(local):
    threading.Timer(0.3, local.interrupt).start()
    r = local.run("sleep 20", timeout=10)
    assert r.exit_code == 130 and not r.timed_out


def test_pool_bounds_and_fresh_sandboxes(tmp_path):
    with SpecPool("local", SandboxSpec(workdir=str(tmp_path)), size=2, warm=1) as pool:
        a = pool.acquire()
        b = pool.acquire()
        a.run("export LEAK=1")
        with pytest.raises(SandboxError, match="no free sandbox"):
            pool.acquire(timeout=0.2)
        pool.release(a)
        c = pool.acquire(timeout=10)
        assert c is not a
        assert c.run("echo ${LEAK:-clean}").output == "clean\n"
        pool.release(b)
        pool.release(c)
        with pool.lease() as d:
            assert d.run("echo hi").output == "hi\n"
    with pytest.raises(ValueError):
        SpecPool("local", size=0)


def test_warm_pool_serves_keys_evicts_idle_and_never_reuses(tmp_path):
    from tmax.sandbox import make_sandbox
    from tmax.sandbox.pool import WarmPool

    def factory():
        return make_sandbox("local", SandboxSpec(workdir=str(tmp_path)))

    with WarmPool(2) as pool:
        assert pool.prewarm("a", factory) and pool.prewarm("b", factory)
        assert not pool.prewarm("c", factory)  # full: two alive
        a = pool.acquire("a", factory, timeout=10)  # waits for the one starting for "a"
        assert pool.warm_hits == 1 and pool.cold_starts == 0
        assert pool.wait_warm(timeout=10) and len(pool._idle["b"]) == 1  # "b" is started and idle
        c = pool.acquire("c", factory, timeout=10)  # no room: the idle "b" is evicted
        assert pool.cold_starts == 1 and not pool._idle.get("b")
        a.run("export LEAK=1")
        pool.release(a)
        a2 = pool.acquire("a", factory, timeout=10)
        assert a2 is not a and a2.run("echo ${LEAK:-clean}").output == "clean\n"
        pool.release(a2)
        pool.release(c)


def test_warm_ahead_starts_the_next_in_line_once_and_retries_when_there_was_no_room(tmp_path):
    """Episodes a, b, c, d run one at a time with two started ahead: as one begins it starts
    sandboxes for the next two that have none; a start the full pool refused is given back
    and made by a later fill."""
    from tmax.sandbox import make_sandbox
    from tmax.sandbox.pool import WarmAhead, WarmPool

    def factory():
        return make_sandbox("local", SandboxSpec(workdir=str(tmp_path)))

    order, asked = ["a", "b", "c", "d"], []
    with WarmPool(3, close_in_background=False) as pool:
        def start(key: str) -> bool:
            asked.append(key)
            return pool.prewarm(key, factory)

        ahead = WarmAhead(2, start)
        assert ahead.fill_after(order, 0, running=1) == 2 and asked == ["b", "c"]
        a = pool.acquire("a", factory, timeout=10)  # the third sandbox: the pool is full
        assert ahead.fill_after(order, 1, running=1) == 0 and asked == ["b", "c", "d"]  # no room for d
        pool.release(a)
        assert ahead.fill_after(order, 1, running=1) == 1 and asked == ["b", "c", "d", "d"]  # c only once
        for key in ("b", "c", "d"):
            pool.release(pool.acquire(key, factory, timeout=10))
        assert pool.warm_hits == 3 and pool.cold_starts == 1


def test_closing_the_pool_during_a_cold_start_leaves_no_sandbox(tmp_path):
    """A rollout worker shutting down closes its pool while an episode is still starting its
    own sandbox (no warm one): close waits for that start, and the new sandbox is closed
    and refused, not handed out to outlive the pool (its process is killed next)."""
    from tmax.sandbox.local import LocalSandbox
    from tmax.sandbox.pool import WarmPool

    starting, made = threading.Event(), []

    class SlowToStart(LocalSandbox):
        def start(self) -> None:
            starting.set()
            time.sleep(1.0)
            super().start()
            self.started_at = time.monotonic()

    def factory():
        made.append(SlowToStart(SandboxSpec(workdir=str(tmp_path))))
        return made[-1]

    pool, errors = WarmPool(2), []

    def episode():
        try:
            pool.acquire("task", factory, timeout=10)
        except SandboxError as e:
            errors.append(str(e))

    t = threading.Thread(target=episode)
    t.start()
    assert starting.wait(5)
    pool.close(in_use=True)
    closed_at = time.monotonic()
    t.join(5)
    assert made[0].started_at <= closed_at  # close waited for the start
    assert made[0].shell is None  # and the sandbox is closed
    assert errors == ["sandbox pool is closed"] and pool._total == 0
