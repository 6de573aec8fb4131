"""Find and remove what tmax left behind: labelled containers (and images), stale podman
services and sandbox temp directories. podman is asked through podman-py, as everywhere
(`sandbox.podman_service`): a service is started for it when none runs, and the stale
services of dead tmax processes are stopped after."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from pathlib import Path

import psutil

if TYPE_CHECKING:
    from podman import PodmanClient

from tmax.sandbox.base import LABEL_KEY, LABEL_VALUE, NAME_PREFIX
from tmax.sandbox.base_image import BASE_LABEL_KEY
from tmax.sandbox import podman_service
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


def labelled_containers(labels: dict[str, str] | None = None) -> list[dict]:
    """podman's records of the containers carrying every one of `labels` and tmax's label."""
    from podman.errors import APIError

    want = {LABEL_KEY: LABEL_VALUE, **(labels or {})}
    try:
        with podman_service.client() as client:
            # One label filter: podman-py writes a list of them as one malformed value.
            listed = [c.attrs for c in client.containers.list(all=True, filters={"label": f"{LABEL_KEY}={LABEL_VALUE}"})]
    except APIError as e:
        raise RuntimeError(str(e)) from e
    return [c for c in listed if all((c.get("Labels") or {}).get(k) == v for k, v in want.items())]


def labelled_images(include_base: bool) -> list[str]:
    from podman.errors import APIError

    ids: list[str] = []
    with podman_service.client() as client:
        for key in [LABEL_KEY] + ([BASE_LABEL_KEY] if include_base else []):
            try:
                ids += [i.id for i in client.images.list(filters={"label": f"{key}={LABEL_VALUE}"}) if i.id not in ids]
            except APIError:
                continue
    return ids


def _remove(remove: Callable[[PodmanClient], object]) -> str | None:
    """Remove a container (killed first) or an image; why not, when podman refused."""
    from podman.errors import APIError, NotFound

    try:
        with podman_service.client() as client:
            remove(client)
    except NotFound:
        return None  # gone meanwhile
    except APIError as e:
        return str(e)
    return None


def _remove_containers(rep: CleanReport, labels: dict[str, str] | None, all_owners: bool, dry_run: bool) -> None:
    try:
        for c in labelled_containers(labels):
            cid, names = c.get("Id", ""), c.get("Names") or []
            owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
            if not all_owners and owner.isdigit() and psutil.pid_exists(int(owner)):
                continue
            rep.containers.append(names[0] if names else cid[:12])
            why = None if dry_run else _remove(lambda client: client.containers.remove(cid, force=True))
            if why is not None:
                rep.errors.append(f"container {cid[:12]}: {why}")
    except RuntimeError as e:
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
                rep.images.append(iid[:12])
                why = None if dry_run else _remove(lambda client: client.images.remove(iid, force=True))
                if why is not None:
                    rep.errors.append(f"image {iid[:12]}: {why}")
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
