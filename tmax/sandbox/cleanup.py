"""Find and remove what tmax left behind: labelled containers (and images), stale podman
services and sandbox temp directories. Uses the podman CLI so it works without a service."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tmax.sandbox.base import LABEL_KEY, LABEL_VALUE, NAME_PREFIX
from tmax.sandbox.base_image import BASE_LABEL_KEY
from tmax.sandbox.podman_service import clean_stale_services

OWNER_LABEL = "io.tmax.pid"  # the tmax process that made a container

STALE_DIR_AGE_S = 3600  # bwrap temp dirs of live sessions are younger than this or in use


@dataclass
class CleanReport:
    containers: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    services: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True)


def labelled_containers(labels: dict[str, str] | None = None) -> list[dict]:
    filters = []
    for k, v in {LABEL_KEY: LABEL_VALUE, **(labels or {})}.items():
        filters += ["--filter", f"label={k}={v}"]
    r = _podman("ps", "-a", *filters, "--format", "json")
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip())
    return json.loads(r.stdout or "[]")


def labelled_images(include_base: bool) -> list[str]:
    ids: list[str] = []
    for key in [LABEL_KEY] + ([BASE_LABEL_KEY] if include_base else []):
        r = _podman("images", "-q", "--no-trunc", "--filter", f"label={key}={LABEL_VALUE}")
        if r.returncode == 0:
            ids += [i for i in r.stdout.split() if i not in ids]
    return ids


def _remove_containers(rep: CleanReport, labels: dict[str, str] | None, all_owners: bool, dry_run: bool) -> None:
    try:
        for c in labelled_containers(labels):
            cid, names = c.get("Id", ""), c.get("Names") or []
            owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
            if not all_owners and owner.isdigit() and psutil.pid_exists(int(owner)):
                continue
            rep.containers.append(names[0] if names else cid[:12])
            if not dry_run:
                r = _podman("rm", "-f", "-t", "0", cid)
                if r.returncode != 0:
                    rep.errors.append(f"container {cid[:12]}: {r.stderr.strip()}")
    except (RuntimeError, json.JSONDecodeError) as e:
        rep.errors.append(f"listing containers: {e}")


def remove_orphaned(labels: dict[str, str]) -> CleanReport:
    """Remove only the containers carrying `labels` whose owning process is gone (a killed
    rollout worker's, or a killed run's found by its run label); nothing else is touched."""
    rep = CleanReport()
    if shutil.which("podman"):
        _remove_containers(rep, labels, all_owners=False, dry_run=False)
    return rep


def remove_labelled(labels: dict[str, str]) -> CleanReport:
    """Remove every container carrying `labels`, whatever its owner: what is left of a run
    once it ended (a container a worker's pool started as the pool closed, say)."""
    rep = CleanReport()
    if shutil.which("podman"):
        _remove_containers(rep, labels, all_owners=True, dry_run=False)
    return rep


def clean(images: bool = False, include_base: bool = False, dry_run: bool = False, all_owners: bool = False,
          labels: dict[str, str] | None = None, tmpdir: str | None = None) -> CleanReport:
    """Remove leftovers. Containers whose owning tmax process is still alive are kept
    unless `all_owners`; `labels` narrows the selection (tests use a unique label)."""
    rep = CleanReport()
    if shutil.which("podman"):
        _remove_containers(rep, labels, all_owners, dry_run)
        if images:
            for iid in labelled_images(include_base):
                rep.images.append(iid.removeprefix("sha256:")[:12])
                if not dry_run:
                    r = _podman("rmi", "-f", iid)
                    if r.returncode != 0:
                        rep.errors.append(f"image {iid[:19]}: {r.stderr.strip()}")
    if not dry_run:
        rep.services = clean_stale_services(tmpdir)
        from tmax.sandbox.overlay_pool import remove_host_dirs

        rep.dirs += remove_host_dirs()  # state directories of shared containers that are gone
    now = time.time()
    for d in Path(tmpdir or tempfile.gettempdir()).glob(NAME_PREFIX + "bwrap-*"):
        try:
            old = now - d.stat().st_mtime > STALE_DIR_AGE_S
        except OSError:
            continue
        if old:
            rep.dirs.append(str(d))
            if not dry_run:
                shutil.rmtree(d, ignore_errors=True)
    return rep
