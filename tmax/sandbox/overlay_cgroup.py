"""An episode's own cgroup inside its container's, where several episodes share a container.

Each episode then has the limits a container of its own had: memory (and memory + swap),
pids and a CPU quota, set on a child of the container's cgroup that the episode's pid 1
joins before it starts anything. On cgroup v1 (this machine kind's hybrid layout) the host
writes the child groups itself, as root; elsewhere `supported()` says no and a container
serves one episode at a time, with the container's own limits (the task's).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD_US = 100_000


def supported() -> bool:
    """Whether this process can give episodes cgroups of their own (root on cgroup v1)."""
    return os.geteuid() == 0 and all((ROOT / c / "cgroup.procs").is_file() for c in CONTROLLERS)


def _groups_of(pid: int) -> dict[str, Path]:
    """The v1 cgroup directory of `pid` per controller this module sets."""
    out: dict[str, Path] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(","):
            if name in CONTROLLERS:
                out[name] = ROOT / name / path.lstrip("/")
    return out


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def warm_migrations() -> None:
    """Take the kernel's lock on cgroup migrations once, in a thread of its own, as an episode
    begins to be made (this process moved into the pids group it is in: nothing changes).
    The first migration after a quiet spell waits for an RCU grace period (~10 ms on a
    shared machine: `cgroup_threadgroup_rwsem`); those that follow within a grace period do
    not. So the episode's own join (`EpisodeCgroup`) waits through what comes before it (a
    fork's capture and freeze, its lease) instead of after it."""
    def take() -> None:
        try:
            _write(_groups_of(os.getpid())["pids"] / "cgroup.procs", str(os.getpid()))
        except (OSError, KeyError):
            pass  # no pids hierarchy of v1 here: the join waits as it would have

    threading.Thread(target=take, name="tmax-cgroup-warm", daemon=True).start()


class EpisodeCgroup:
    """The cgroups of one episode: created with its limits around `pid` (the episode's pid 1,
    still alone), removed once the episode is over."""

    def __init__(self, pid: int, name: str, memory_mb: int | None, pids_limit: int | None, cpus: float | None):
        self.dirs: list[Path] = []
        limits = {
            "memory": [("memory.limit_in_bytes", memory_mb and str(memory_mb * 1024 * 1024)),
                       ("memory.memsw.limit_in_bytes", memory_mb and str(memory_mb * 1024 * 1024))],
            "pids": [("pids.max", pids_limit and str(pids_limit))],
            "cpu": [("cpu.cfs_period_us", cpus and str(CFS_PERIOD_US)),
                    ("cpu.cfs_quota_us", cpus and str(int(cpus * CFS_PERIOD_US)))],
        }
        try:
            for controller, parent in _groups_of(pid).items():
                d = parent / name
                d.mkdir()
                self.dirs.append(d)
                for key, value in limits[controller]:
                    if value and (d / key).exists():  # memsw only with swap accounting on
                        _write(d / key, value)
                _write(d / "cgroup.procs", str(pid))
        except OSError:
            self.remove(wait_s=0)
            raise

    def remove(self, wait_s: float = 5.0) -> bool:
        """Delete the groups once their processes are gone (the episode's end kills them, the
        kernel takes a moment); False if one is still busy after `wait_s`."""
        deadline = time.monotonic() + wait_s
        left = []
        removed_parents = {d.parent for d in self.dirs}
        for d in reversed(self.dirs):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        left.append(d)
                        break
                    time.sleep(0.02)
        self.dirs = left
        for d in removed_parents:
            try:
                d.rmdir()  # a killed container's group, which podman could not remove past ours
            except OSError:
                pass  # a live container's: it has processes
        return not left
