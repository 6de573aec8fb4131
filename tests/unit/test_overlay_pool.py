"""What the overlay pool serves and what falls back to a fresh container, how hosts are keyed,
and the registry's refusal of a directory others can write (no podman here)."""

from __future__ import annotations

from dataclasses import replace

from tmax.sandbox.base import SandboxSpec
from tmax.sandbox.overlay_pool import OverlayPool, host_key

SPEC = SandboxSpec(image="localhost/x:1", workdir="/app", memory_mb=512, pids_limit=64, cpus=1.0,
                   mounts=[("/etc/ssl/certs", "/etc/ssl/certs", True)])


def test_what_the_overlay_serves_and_what_falls_back(tmp_path):
    pool = OverlayPool(4, root=tmp_path / "hosts")
    assert pool.unsupported(SPEC, None) is None  # read-only mounts are fine
    assert "workspace" in pool.unsupported(replace(SPEC, workspace=tmp_path), None)
    assert "writable" in pool.unsupported(replace(SPEC, mounts=[(str(tmp_path), "/data", False)]), None)
    assert pool.unsupported(SandboxSpec(), None) == "not a podman sandbox"
    pool.close()


def test_hosts_are_keyed_by_image_limits_and_labels_not_by_the_episode(tmp_path):
    key = host_key(SPEC, {"io.tmax.run": "a"})
    assert key == host_key(replace(SPEC, user="user", shell=False, name="x", labels={"t": "1"}), {"io.tmax.run": "a"})
    assert key != host_key(replace(SPEC, memory_mb=64), {"io.tmax.run": "a"})
    assert key != host_key(replace(SPEC, network=True), {"io.tmax.run": "a"})
    assert key != host_key(SPEC, {"io.tmax.run": "b"})


def test_a_registry_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    pool = OverlayPool(4, root=shared)
    why = pool.unsupported(SPEC, None)
    assert why and "not this user's alone" in why  # a socket planted there would get this process's files
    pool.close()
