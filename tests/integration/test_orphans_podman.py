"""A killed run's or rollout worker's containers are found by the run label and removed
when their owning process is gone; a live owner's containers, and every container without
the label, are left alone. Once a run ended, every container with its label goes."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from tmax.sandbox.cleanup import remove_labelled, remove_orphaned
from tmax.training.rollout import RUN_LABEL, run_labels

pytestmark = pytest.mark.podman


def _container(image: str, owner: int, labels: dict[str, str]) -> str:
    argv = ["podman", "run", "-d", "--rm=false", "--label", "io.tmax.managed=1", "--label", f"io.tmax.pid={owner}"]
    for k, v in labels.items():
        argv += ["--label", f"{k}={v}"]
    return subprocess.run(argv + [image, "sleep", "infinity"], capture_output=True, text=True, check=True).stdout.strip()


def _exists(cid: str) -> bool:
    return subprocess.run(["podman", "container", "exists", cid]).returncode == 0


def test_remove_orphaned_takes_only_the_runs_containers_of_dead_owners(base_image, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    run, other = run_labels(tmp_path / "run"), {RUN_LABEL: uuid.uuid4().hex[:16]}
    assert run == run_labels(tmp_path / "run" / ".." / "run")  # the same run dir, the same label
    orphan = _container(base_image, dead.pid, run)
    live = _container(base_image, os.getpid(), run)
    elsewhere = _container(base_image, dead.pid, other)
    try:
        rep = remove_orphaned(run)
        assert len(rep.containers) == 1 and not rep.errors
        assert not _exists(orphan) and _exists(live) and _exists(elsewhere)
        # A run that ended removes what carries its label, a live owner's too (`Actors.close`).
        rep = remove_labelled(run)
        assert len(rep.containers) == 1 and not rep.errors
        assert not _exists(live) and _exists(elsewhere)
    finally:
        for cid in (orphan, live, elsewhere):  # one at a time: a missing one fails the whole rm
            subprocess.run(["podman", "rm", "-f", "-t", "0", cid], capture_output=True)
