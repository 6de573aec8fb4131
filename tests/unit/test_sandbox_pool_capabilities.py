"""Pools and sandboxes say what they can do (`SandboxCapabilities`), and callers branch on that:
`make_pool` is the only place that picks a pool for a sandbox kind (no podman needed here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tmax
from tmax.cli.run_undo import untracked_note
from tmax.sandbox import SandboxError, SandboxSpec, make_sandbox, sandbox_class
from tmax.sandbox.overlay_pool import OverlayPool
from tmax.sandbox.pool import SpecFactory, WarmPool
from tmax.sandbox.pool_factory import make_pool, pool_serves_overlays
from tmax.sandbox.snapshot import snapshot_store
from tmax.sandbox.watched import WatchedSnapshots
from tmax.tasks.hostenv import HostEnv, HostPlan


def test_make_pool_picks_the_pool_for_the_kind_and_settings(tmp_path):
    overlay = make_pool("podman", 2, 1, overlay=True, root=tmp_path / "hosts")
    fresh = make_pool("podman", 2, 3)
    try:
        assert isinstance(overlay, OverlayPool) and overlay.capacity == 3
        assert overlay.capabilities().overlay and overlay.capabilities().limits and overlay.capabilities().own_root
        assert isinstance(fresh, WarmPool) and fresh.capacity == 5
        assert not fresh.capabilities().overlay  # it knows nothing of a sandbox it was not given
        assert fresh.capabilities(SpecFactory("podman", SandboxSpec(image="x"))).limits
    finally:
        overlay.close()
        fresh.close()
    assert make_pool("podman", 2, 0) is None  # nothing started ahead: each episode starts its own
    assert make_pool("bwrap", 2, 4, overlay=True) is None and make_pool("local", 1, 1) is None
    assert pool_serves_overlays("podman", True) and not pool_serves_overlays("podman", False)
    assert not pool_serves_overlays("bwrap", True)


def test_a_spec_the_overlay_cannot_serve_reports_a_container_of_its_own(tmp_path):
    pool = OverlayPool(2, root=tmp_path / "hosts")
    try:
        writable = SandboxSpec(image="x", mounts=[(str(tmp_path), "/data", False)])
        caps = pool.capabilities(SpecFactory("podman", writable))
        assert not caps.overlay and caps.snapshot == "container" and caps.limits
        assert pool.capabilities(SpecFactory("podman", SandboxSpec(image="x"))).overlay
    finally:
        pool.close()


def test_each_backend_says_what_it_can_do():
    local, bwrap, podman = (sandbox_class(k).capabilities for k in ("local", "bwrap", "podman"))
    assert (local.snapshot, bwrap.snapshot, podman.snapshot) == ("workdir", "jail", "container")
    assert podman.limits and podman.network and not podman.overlay and not podman.fork
    assert bwrap.network and bwrap.workspace_target and not bwrap.limits
    assert not local.network and not local.limits and not local.workspace_target
    # Only a container has a root of its own (where the oracle puts /solution).
    assert podman.own_root and not bwrap.own_root and not local.own_root


def test_undo_snapshots_follow_the_sandboxes_scope(tmp_path):
    box = make_sandbox("local", SandboxSpec(workdir=str(tmp_path)))
    box.start()
    try:
        store = snapshot_store(box)
        assert isinstance(store, WatchedSnapshots)
        store.close()
    finally:
        box.close()
    assert str(tmp_path) in untracked_note("workdir", str(tmp_path))
    assert "jail" in untracked_note("jail", "/app") and "container" in untracked_note("container", "/app")

    class NoSnapshots:
        kind = "custom"
        capabilities = sandbox_class("podman").capabilities.model_copy(update={"snapshot": None})

    with pytest.raises(SandboxError, match="custom sandbox keeps no snapshots"):
        snapshot_store(NoSnapshots())


def test_a_host_workspace_appears_where_the_sandbox_puts_it(tmp_path):
    plan = HostPlan(workdir="/app")
    jail, host = HostEnv("bwrap", plan, tmp_path, tmp_path / "ws"), HostEnv("local", plan, tmp_path, tmp_path / "ws")
    assert jail.workdir == "/app" and jail.spec(False).workspace_target == "/app"
    assert host.workdir == str(tmp_path / "ws") and host.spec(False).workspace_target is None


def test_no_pool_or_sandbox_kind_branch_outside_the_factories():
    """Callers ask for a capability: a pool's class, or a sandbox kind compared by name, is
    looked at only where pools and sandboxes are made."""
    root = Path(tmax.__file__).parent
    factories = {root / "sandbox" / "pool_factory.py", root / "sandbox" / "__init__.py"}
    branch = re.compile(r"isinstance\([^)]*(Pool|OverlayPool|WarmPool|Sandbox)\b|\bkind\s*[!=]=\s*\"(podman|bwrap|local)\"")
    found = [(str(p.relative_to(root)), line.strip()) for p in root.rglob("*.py") if p not in factories
             for line in p.read_text().splitlines() if branch.search(line)]
    # Harbor's name for the environment type, in the record written for it: not a branch in behaviour.
    assert found == [("tasks/job.py", 'if kind == "podman":')]


def test_every_pool_is_a_sandbox_pool(tmp_path):
    """What `SandboxPool` declares, every pool has, with the same parameters."""
    import inspect

    from tmax.sandbox.pool import SandboxPool

    declared = {n for n in vars(SandboxPool) if not n.startswith("_")} | set(SandboxPool.__annotations__)
    pools = [WarmPool(1), OverlayPool(1, root=tmp_path / "hosts")]
    try:
        for pool in pools:
            assert all(hasattr(pool, n) for n in declared), type(pool).__name__
            for n in declared:
                want = vars(SandboxPool).get(n)
                if inspect.isfunction(want):
                    assert list(inspect.signature(getattr(pool, n)).parameters) == \
                        list(inspect.signature(want).parameters)[1:], (type(pool).__name__, n)
    finally:
        for pool in pools:
            pool.close()
