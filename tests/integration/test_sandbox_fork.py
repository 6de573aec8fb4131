"""Forking a live sandbox (`sandbox.fork`), for each kind: local, bwrap and overlay episodes of
podman. A child starts in its parent's state (files, cwd, exported variables, functions,
aliases); what any of them does afterwards (a file written, a file deleted, a cd, an export)
stays in its own branch; processes are not carried, and one running at the fork is named in
the record. Overlay forks stand on frozen layers: deep chains stay short (merged), a fork the
host has no room for leaves the parent as it was, a killed host fails its branches and the
next episode gets a new one, and nothing is left once the branches and the pool end.

Real bash, bwrap, podman and the episode helper; the base image for podman."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from tmax.sandbox import SandboxSpec
from tmax.sandbox.base import SandboxError
from tmax.sandbox.bwrap import available as bwrap_available
from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory
from tmax.sandbox.overlay_proto import EpisodeLease, HostBusy
from tmax.sandbox.pool import WarmPool

TEST_LABEL = "io.tmax.test-fork"
KINDS = [
    "local",
    pytest.param("bwrap", marks=[pytest.mark.bwrap, pytest.mark.skipif(not bwrap_available(), reason="no bwrap")]),
    pytest.param("podman", marks=pytest.mark.podman),
]


@pytest.fixture(scope="module")
def overlay_pool(tmp_path_factory):
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    pool = OverlayPool(3, host_labels=label, root=tmp_path_factory.mktemp("fork-hosts"), close_in_background=False)
    yield pool
    pool.close(in_use=True)
    from tmax.sandbox.cleanup import remove_labelled

    remove_labelled(label)


@pytest.fixture
def branches(request, tmp_path):
    """`(pool, factory)` of the test's sandbox kind: a pool that forks what it hands out."""
    kind = request.param
    if kind == "podman":
        spec = SandboxSpec(image=request.getfixturevalue("base_image"), workdir="/root")
        pool = request.getfixturevalue("overlay_pool")
        yield pool, SpecFactory("podman", spec)
        return
    (tmp_path / "work").mkdir()
    spec = SandboxSpec(workdir=str(tmp_path / "work")) if kind == "local" else SandboxSpec()
    pool = WarmPool(4, close_in_background=False)
    yield pool, SpecFactory(kind, spec)
    pool.close(in_use=True)


def out(sb, command: str) -> str:
    r = sb.run(command, timeout=60)
    assert r.exit_code == 0, (command, r.output)
    return r.output.strip()


def state(sb) -> str:
    """What the tests compare: cwd's name, files there, $V, the function and the alias."""
    return out(sb, 'echo "${PWD##*/} [$(ls | tr "\\n" " ")] V=$V $(greet x) $(hello)"')


@pytest.mark.parametrize("branches", KINDS, indirect=True)
def test_each_branch_keeps_its_own_writes_deletes_cwd_and_exports(branches):
    pool, factory = branches
    assert pool.capabilities(factory).fork
    parent = pool.acquire("k", factory)
    try:
        out(parent, "mkdir -p w && cd w && echo keep > keep && echo del > del && export V=parent")
        out(parent, "greet() { echo hi-$1; }; alias hello='echo aliased'; sleep 3217 &")
        before = state(parent)
        assert before == "w [del keep ] V=parent hi-x aliased"
        one, two = pool.fork(parent), pool.fork(parent)
        assert [p.command for p in one.record.background] == ["sleep 3217"]  # named, not carried
        assert "greet" in one.record.functions and one.record.aliases == ["hello"] and "V" in one.record.exported
        a, b = one.sandbox, two.sandbox
        assert state(a) == state(b) == before
        assert out(a, "jobs -p | wc -l") == "0"  # a new shell: the parent's job is not its own

        out(a, "echo a > new-a && rm del && mkdir a-dir && cd a-dir && export V=a")
        out(b, "echo b > new-b && rm keep && cd .. && export V=b")
        out(parent, "echo p > after-fork")
        assert state(a) == "a-dir [] V=a hi-x aliased"
        assert out(a, "ls -1 ..") == "a-dir\nkeep\nnew-a"
        assert out(b, "ls -1 w") == "del\nnew-b"
        assert out(b, "echo $V") == "b"
        assert state(parent) == "w [after-fork del keep ] V=parent hi-x aliased"
        assert out(parent, "cat keep del") == "keep\ndel"
        pool.release(a)
        pool.release(b)
    finally:
        pool.release(parent)


@pytest.mark.parametrize("branches", KINDS, indirect=True)
def test_a_child_forks_again_and_its_own_child_sees_its_state(branches):
    pool, factory = branches
    parent = pool.acquire("k", factory)
    try:
        out(parent, "mkdir -p g && cd g && echo 0 > gen")
        sb = parent
        for n in range(1, 4):
            child = pool.fork(sb).sandbox
            if sb is not parent:
                pool.release(sb)  # the child stands on what its parent had: it needs nothing more of it
            out(child, f"echo {n} >> gen && export GEN={n}")
            sb = child
        assert out(sb, "cat gen; echo $GEN") == "0\n1\n2\n3\n3"
        assert out(parent, "cat gen") == "0"
        pool.release(sb)
    finally:
        pool.release(parent)


def test_a_plain_container_says_it_cannot_fork(base_image):
    pool = WarmPool(1, close_in_background=False)
    factory = SpecFactory("podman", SandboxSpec(image=base_image, shell=False))
    assert not pool.capabilities(factory).fork
    sb = pool.acquire("k", factory)
    try:
        with pytest.raises(SandboxError, match="cannot fork"):
            pool.fork(sb)
    finally:
        pool.close(in_use=True)


# -- overlay episodes: layers, chains, failures -------------------------------------------------

def _layers(sb) -> list[str]:
    return sorted(p.name for p in (Path(sb.host.state_dir) / "layers").glob("*"))


@pytest.mark.podman
def test_a_deep_chain_of_forks_is_merged_and_stays_exact(overlay_pool, base_image):
    pool, factory = overlay_pool, SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    root = pool.acquire("k", factory)
    sb, depths = root, []
    try:
        out(root, "mkdir -p /app/keep && echo base > /app/keep/file && echo x > /app/gone && mkdir /app/d0")
        for n in range(1, 12):
            # A file added, one deleted, a directory replaced by one of the same name (opaque).
            out(sb, f"echo {n} >> /app/keep/file && touch /app/f{n} && rm -f /app/f{n - 1} /app/gone"
                    f" && rm -rf /app/d{n - 1} && mkdir /app/d{n} && rm -rf /app/keep/sub && mkdir /app/keep/sub"
                    f" && echo {n} > /app/keep/sub/only")
            forked = pool.fork(sb)
            depths.append(forked.record.layers)
            if sb is not root:
                pool.release(sb)
            sb = forked.sandbox
        assert depths == [*range(1, 9), 1, 2, 3]  # a ninth layer: the chain became one layer
        assert out(sb, "ls -1 /app /app/keep/sub; cat /app/keep/sub/only") == "/app:\nd11\nf11\nkeep\n\n/app/keep/sub:\nonly\n11"
        assert out(sb, "cat /app/keep/file") == "\n".join(["base", *map(str, range(1, 12))])
        assert out(root, "ls -1 /app; cat /app/keep/file") == "d1\nf1\nkeep\nbase\n1"  # a branch of its own
        assert len(_layers(sb)) <= 8 + 2  # the layers nobody stands on went
    finally:
        if sb is not root:
            pool.release(sb)
        pool.release(root)


@pytest.mark.podman
def test_a_fork_the_host_has_no_room_for_leaves_the_parent_as_it_was(overlay_pool, base_image):
    pool, factory = overlay_pool, SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    held = [pool.acquire("k", factory) for _ in range(3)]  # the host's three episodes
    try:
        parent = held[0]
        if any(sb.host.state_dir != parent.host.state_dir for sb in held):
            pytest.skip("the episodes went to different hosts")
        out(parent, "echo kept > /root/mine && cd /tmp && export V=1; sleep 999 &")
        with pytest.raises(HostBusy):
            pool.fork(parent)
        assert out(parent, "cat /root/mine; pwd; echo $V; jobs | wc -l") == "kept\n/tmp\n1\n1"
    finally:
        for sb in held:
            pool.release(sb)


@pytest.mark.podman
def test_a_killed_host_fails_its_branches_and_nothing_is_left(base_image, tmp_path_factory):
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    root = tmp_path_factory.mktemp("kill")  # short: a socket's path must be
    factory = SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    with OverlayPool(3, host_labels=label, root=root, close_in_background=False) as pool:
        parent = pool.acquire("k", factory)
        out(parent, "echo x > /root/f")
        child = pool.fork(parent).sandbox
        subprocess.run(["podman", "kill", parent.container_id], capture_output=True, check=True)
        for sb in (parent, child):
            with pytest.raises(SandboxError):
                for _ in range(3):
                    sb.run("cat /root/f", timeout=30)
            pool.release(sb)
        fresh = pool.acquire("k", factory)
        assert fresh.container_id != parent.container_id and out(fresh, "echo ok") == "ok"
        out(fresh, "echo y > /root/g")
        pool.release(pool.fork(fresh).sandbox)
        pool.release(fresh)

    def containers() -> str:
        return subprocess.run(["podman", "ps", "-aq", "--filter", f"label={TEST_LABEL}={label[TEST_LABEL]}"],
                              capture_output=True, text=True).stdout.strip()

    from tmax.common.waiting import wait_until

    assert wait_until(lambda: containers() == "", 60, 0.5)
    assert not list(root.glob("*/h-*"))  # state directories, frozen layers and all


@pytest.mark.podman
def test_a_fork_that_fails_halfway_loses_nothing_and_leaves_nothing(overlay_pool, base_image, monkeypatch):
    """The child's episode fails after the parent's was frozen: the parent comes back on its
    state; the room kept for the child is given back; the frozen layer goes with the parent."""
    from tmax.common.waiting import wait_until
    from tmax.sandbox.overlay import OverlaySandbox

    pool, factory = overlay_pool, SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    parent = pool.acquire("k", factory)
    state_dir = Path(parent.host.state_dir)
    out(parent, "echo kept > /root/mine && cd /tmp && export V=1")

    def fails(*_a, **_k):
        raise SandboxError("injected: the child's episode could not be made")

    monkeypatch.setattr(OverlaySandbox, "_lease", fails)
    with pytest.raises(SandboxError, match="injected"):
        pool.fork(parent)
    monkeypatch.undo()
    try:
        # Two of the host's three rooms are free: the child's came back, the parent's is kept.
        others = [EpisodeLease(state_dir, uuid.uuid4().hex[:12], True) for _ in range(2)]
        with pytest.raises(HostBusy):
            EpisodeLease(state_dir, uuid.uuid4().hex[:12], True)
        for lease in others:
            lease.close()
        assert out(parent, "cat /root/mine; pwd; echo $V") == "kept\n/tmp\n1"
        assert wait_until(lambda: len(_layers(parent)) == 1, 10, 0.1)  # the one the parent stands on
    finally:
        pool.release(parent)
    assert wait_until(lambda: _layers(parent) == [], 10, 0.1)


@pytest.mark.podman
def test_a_child_killed_while_it_starts_leaves_the_parent_its_room(overlay_pool, base_image, monkeypatch):
    """The child's episode is made (its room taken) and then dies in its start (its pid 1
    killed before its shell answers): the fork raises, the parent's room stays kept and it
    comes back on its state; then every room and layer is free."""
    import os
    import signal

    from tmax.common.waiting import wait_until
    from tmax.sandbox.overlay import OverlaySandbox

    pool, factory = overlay_pool, SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    parent = pool.acquire("k", factory)
    state_dir = Path(parent.host.state_dir)
    out(parent, "echo kept > /root/mine && cd /tmp && export V=1")
    start_shell = OverlaySandbox._start_shell

    def killed_first(sb):
        os.kill(sb.lease.peer_pid(), signal.SIGKILL)
        start_shell(sb)

    monkeypatch.setattr(OverlaySandbox, "_start_shell", killed_first)
    with pytest.raises(SandboxError):
        pool.fork(parent)
    monkeypatch.undo()
    try:
        assert out(parent, "cat /root/mine; pwd; echo $V") == "kept\n/tmp\n1"
    finally:
        pool.release(parent)
    assert wait_until(lambda: _layers(parent) == [], 10, 0.1)
    rooms = [EpisodeLease(state_dir, uuid.uuid4().hex[:12], True) for _ in range(3)]  # all three free
    for lease in rooms:
        lease.close()


@pytest.mark.podman
def test_a_parent_that_cannot_come_back_leaves_nothing(overlay_pool, base_image, monkeypatch):
    """The parent's continuation fails at its next use (an infrastructure error of the
    parent's): its child goes on; once both end, no room or layer of the fork is left."""
    from tmax.common.waiting import wait_until
    from tmax.sandbox.overlay import OverlaySandbox

    pool, factory = overlay_pool, SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    parent = pool.acquire("k", factory)
    state_dir = Path(parent.host.state_dir)
    out(parent, "echo x > /root/f")
    child = pool.fork(parent).sandbox

    def fails(*_a, **_k):
        raise SandboxError("injected: the parent's episode could not be made")

    monkeypatch.setattr(OverlaySandbox, "_lease", fails)
    with pytest.raises(SandboxError, match="injected"):
        parent.run("cat /root/f")
    monkeypatch.undo()
    assert out(child, "cat /root/f") == "x"
    pool.release(child)
    pool.release(parent)
    assert wait_until(lambda: not list((state_dir / "layers").glob("*")), 10, 0.1)
    rooms = [EpisodeLease(state_dir, uuid.uuid4().hex[:12], True) for _ in range(3)]  # all three free
    for lease in rooms:
        lease.close()


@pytest.mark.podman
def test_a_parent_forked_again_unused_costs_its_children_alone(overlay_pool, base_image):
    """Forked twice without a command between: both children stand on the one frozen layer,
    and the parent comes back only when it is used."""
    pool, factory = overlay_pool, SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root"))
    parent = pool.acquire("k", factory)
    try:
        out(parent, "echo one > /root/f; sleep 500 &")
        first, second = pool.fork(parent), pool.fork(parent)
        assert [p.command for p in first.record.background] == ["sleep 500"] and second.record.background == []
        assert first.sandbox.layer.id == second.sandbox.layer.id  # one freeze: the parent was not back between
        assert parent.shell is None  # not back yet
        assert out(second.sandbox, "cat /root/f") == out(parent, "cat /root/f") == "one"
        for forked in (first, second):
            pool.release(forked.sandbox)
    finally:
        pool.release(parent)


_DIES_AFTER_FREEZE = """
import os, sys
from tmax.sandbox import SandboxSpec
from tmax.sandbox.overlay import OverlaySandbox
from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory

pool = OverlayPool(3, host_labels={sys.argv[3]: sys.argv[4]}, root=sys.argv[1], close_in_background=False)
parent = pool.acquire("k", SpecFactory("podman", SandboxSpec(image=sys.argv[2], workdir="/root")))
parent.run("echo x > /root/f")
print(parent.host.state_dir, flush=True)
OverlaySandbox._episode_on = lambda *a, **k: os._exit(3)  # dies between the freeze and the child
pool.fork(parent)
"""


@pytest.mark.podman
def test_a_forker_that_dies_after_the_freeze_leaves_no_room_or_layer(base_image, tmp_path_factory):
    """The process forking is killed halfway (after its episode was frozen, before the child):
    its connections close with it, and the host gives back every room and layer it held."""
    import sys

    from tmax.common.waiting import wait_until
    from tmax.sandbox.cleanup import remove_labelled
    from tmax.sandbox.overlay_proto import quit_host

    label = uuid.uuid4().hex[:12]
    root = tmp_path_factory.mktemp("dies")
    r = subprocess.run([sys.executable, "-c", _DIES_AFTER_FREEZE, str(root), base_image, TEST_LABEL, label],
                       capture_output=True, text=True, timeout=300)
    try:
        assert r.returncode == 3, r.stderr
        state_dir = Path(r.stdout.strip())
        assert wait_until(lambda: not list((state_dir / "layers").glob("*")), 10, 0.1)
        rooms = [EpisodeLease(state_dir, uuid.uuid4().hex[:12], True) for _ in range(3)]  # all three free
        for lease in rooms:
            lease.close()
        quit_host(state_dir)
    finally:
        remove_labelled({TEST_LABEL: label})


@pytest.mark.podman
def test_a_child_has_its_parents_limits_and_network_rules(overlay_pool, base_image):
    pool = overlay_pool
    factory = SpecFactory("podman", SandboxSpec(image=base_image, workdir="/root", memory_mb=300, pids_limit=50))
    parent = pool.acquire("k", factory)
    try:
        child = pool.fork(parent).sandbox
        limits = {d.relative_to("/sys/fs/cgroup").parts[0]: d for d in child.cgroup.dirs}  # the child's own
        assert (limits["memory"] / "memory.limit_in_bytes").read_text().strip() == str(300 * 1024 * 1024)
        assert (limits["pids"] / "pids.max").read_text().strip() == "50"
        # No network: the child's namespace has only loopback, as its parent's had.
        assert out(child, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '") == "lo"
        pool.release(child)
    finally:
        pool.release(parent)
