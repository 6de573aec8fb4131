"""What the overlay pool serves and what falls back to a fresh container, how hosts are keyed,
and the registry's refusal of a directory others can write (no podman here)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tmax.sandbox.base import FilesLayer, LayerCopy, LayerDir, SandboxError, SandboxSpec
from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory, host_key
from tmax.tasks.episode import pool_key

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


def test_files_layers_of_one_base_image_share_its_hosts_not_their_pool_keys():
    a = replace(SPEC, workdir="/app", files=FilesLayer((LayerDir("/app"), LayerCopy(("/t/a",), "/app", True)), "/app"))
    b = replace(SPEC, workdir="/srv", files=FilesLayer((LayerDir("/srv"),), "/srv"))
    base = replace(SPEC, workdir=None)
    assert host_key(a, {}) == host_key(b, {}) == host_key(base, {})  # the base image's host serves both
    assert host_key(a, {}) != host_key(replace(a, memory_mb=64), {})
    assert len({pool_key(a), pool_key(b), pool_key(base)}) == 3  # a fallback's container is the task's own


def test_a_files_layer_alone_makes_no_sandbox_its_own_image_does():
    layer = replace(SPEC, files=FilesLayer((LayerDir("/app"),), "/app"))
    with pytest.raises(SandboxError, match="files layer"):
        SpecFactory("podman", layer)()
    built = SpecFactory("podman", layer, own_image=lambda: replace(SPEC, image="localhost/task:built"))()
    assert built.mode == "container" and built.image == "localhost/task:built"  # not started: no podman call


def test_a_registry_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    pool = OverlayPool(4, root=shared)
    why = pool.unsupported(SPEC, None)
    assert why and "not this user's alone" in why  # a socket planted there would get this process's files
    pool.close()
