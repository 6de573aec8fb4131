"""Undo of what shell commands did: snapshots of a sandbox's files, taken before commands.

`UndoHistory(store, keep)` takes a snapshot before each command (`before(command)`) and
keeps the last `keep`; `undo(k)` puts the files back as they were before the k-th last
command. Two stores, chosen by the sandbox's `capabilities.snapshot` in
`snapshot_store(box)`:

* `WatchedSnapshots` (local, bwrap; `sandbox.watched`): a change log. inotify says what a
  command changed; only those paths are copied (the old version into the snapshot's
  pre-images, the new one into a mirror of the directory), so a snapshot costs in proportion
  to what changed, not to the size of the workspace. bwrap's /tmp and $HOME are logged too.
* `ContainerSnapshots` (podman): diff-based. The container's changes against its image
  (`podman diff`) are archived inside the container with tar; a restore deletes what was
  added since, extracts the archive, and takes files changed since from the image itself.
  `podman commit` was measured as the alternative (benchmarks/undo_cost.py): it costs more
  per step and restoring a committed image means a new container, losing the live shell.

Only files come back: processes, the shell's variables and its history stay as they are.
Nothing here runs when undo is off (no store is made).
"""

from __future__ import annotations

import io
import shlex
import subprocess
import tarfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmax.sandbox.base import IMAGE_USER, LABEL_KEY, LABEL_VALUE, Sandbox, SandboxError
from tmax.sandbox.undo_store import Restored, SnapshotStore
from tmax.sandbox.watched import JAIL_TMP_IGNORED, OWN_PREFIX, WatchedSnapshots

if TYPE_CHECKING:
    from tmax.sandbox.podman import PodmanSandbox


def _run(argv: list[str], what: str, cwd: Path | None = None) -> bytes:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, timeout=600)
    if r.returncode != 0:
        raise SandboxError(f"undo: {what} failed: {r.stderr.decode(errors='replace').strip()[-500:]}")
    return r.stdout


class SnapshotGroup:
    """Several directories snapshotted and restored together (a jail's workspace, /tmp, home)."""

    def __init__(self, stores: list[Any]) -> None:
        self.stores = stores

    def save(self, n: int) -> None:
        for s in self.stores:
            s.save(n)

    def restore(self, n: int) -> Restored:
        restored = Restored()
        for s in self.stores:
            restored = restored + s.restore(n)
        return restored

    def drop(self, n: int) -> None:
        for s in self.stores:
            s.drop(n)

    def close(self) -> None:
        for s in self.stores:
            s.close()


@dataclass
class Undone:
    commands: list[str]  # oldest first
    restored: Restored = field(default_factory=Restored)


class UndoHistory:
    """Snapshots before the last `keep` commands, newest last."""

    def __init__(self, store: SnapshotStore, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"undo needs at least one step, got {keep}")
        self.store = store
        self.keep = keep
        self._entries: deque[tuple[int, str]] = deque()  # (snapshot number, command)
        self._next = 0

    @property
    def available(self) -> int:
        return len(self._entries)

    def before(self, command: str) -> None:
        """Snapshot now, before `command` runs."""
        n, self._next = self._next, self._next + 1
        self.store.save(n)
        self._entries.append((n, command))
        while len(self._entries) > self.keep:
            self.store.drop(self._entries.popleft()[0])

    def undo(self, k: int = 1) -> Undone:
        """Restore the state from before the k-th last command; those k snapshots are used up."""
        if k < 1:
            raise ValueError(f"/undo needs a positive number of commands, got {k}")
        if k > len(self._entries):
            raise ValueError(f"only {len(self._entries)} command(s) can be undone (snapshots are kept for "
                             f"the last {self.keep})")
        undone = [self._entries.pop() for _ in range(k)]
        target = undone[-1][0]
        restored = self.store.restore(target)
        for n, _ in undone:
            self.store.drop(n)
        return Undone([cmd for _, cmd in reversed(undone)], restored)

    def close(self) -> None:
        self.store.close()


# -- podman -------------------------------------------------------------------------------

SNAP_DIR = "/.tmax-undo"
# Paths podman manages itself (bind mounts, kernel filesystems) are never part of a snapshot.
_IGNORED = ("/proc", "/sys", "/dev", "/run/.containerenv", "/etc/hosts", "/etc/hostname",
            "/etc/resolv.conf", SNAP_DIR)
_ADDED, _CHANGED, _DELETED = "A", "C", "D"
ARGV_PATH_BYTES = 100_000  # longer path lists go to tar through a file


def _ignored(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in _IGNORED)


class ContainerSnapshots:
    """Diff-based snapshots of a podman sandbox's filesystem, kept inside the container."""

    def __init__(self, box: PodmanSandbox) -> None:
        if box.container is None:
            raise SandboxError("undo: the podman sandbox is not started")
        self.box = box
        self.image = box.image
        self._diffs: dict[int, dict[str, str]] = {}
        self._dropped: list[str] = []
        self._exec(["mkdir", "-p", SNAP_DIR], "making the snapshot directory")

    def _exec(self, argv: list[str], what: str) -> str:
        r = self.box.exec(argv, timeout=300, user=IMAGE_USER)  # the whole filesystem: not the agent's user
        if r.exit_code != 0:
            raise SandboxError(f"undo: {what} failed in the container: {(r.stderr or r.output).strip()[-500:]}")
        return r.output

    def diff(self) -> dict[str, str]:
        """path -> A | C | D, against the image."""
        kinds = {0: _CHANGED, 1: _ADDED, 2: _DELETED}
        changes = self.box.container.diff()
        return {c["Path"]: kinds[c["Kind"]] for c in changes if not _ignored(c["Path"])}

    def _put_text(self, name: str, text: str) -> None:
        data = text.encode()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if not self.box.container.put_archive(SNAP_DIR, buf.getvalue()):
            raise SandboxError("undo: could not write into the container")

    def save(self, n: int) -> None:
        diff = self.diff()
        present = [p.lstrip("/") for p in sorted(p for p, kind in diff.items() if kind != _DELETED)]
        tar = ["tar", "-c", "--no-recursion", "-f", f"{SNAP_DIR}/{n}.tar", "-C", "/", "-T"]
        if sum(len(p) + 1 for p in present) < ARGV_PATH_BYTES:
            tar += ["/dev/null", "--", *present]
        else:
            self._put_text(f"{n}.list", "".join(p + "\n" for p in present))
            tar.append(f"{SNAP_DIR}/{n}.list")
        # One exec (each costs ~0.2 s) also removes the snapshots dropped since the last one.
        drops, self._dropped = " ".join(shlex.quote(p) for p in self._dropped), []
        self._exec(["sh", "-c", f"rm -f -- {drops} && exec \"$@\"", "sh", *tar], "archiving the changes")
        self._diffs[n] = diff

    def restore(self, n: int) -> Restored:
        target, now = self._diffs[n], self.diff()
        # Gone at the snapshot, or added since: remove. Changed or deleted since (but as in the
        # image at the snapshot): take the image's version.
        remove = [p for p, kind in target.items() if kind == _DELETED and now.get(p) != _DELETED]
        remove += [p for p, kind in now.items() if kind == _ADDED and p not in target]
        from_image = [p for p, kind in now.items() if kind in (_CHANGED, _DELETED) and p not in target]
        if remove:
            self._exec(["rm", "-rf", "--", *sorted(remove, reverse=True)], "removing files added since")
        if from_image:
            self._restore_from_image(sorted(from_image), now)
        # tar --compare first: the archived paths that differ now are the ones the extraction restores.
        archive = f"{SNAP_DIR}/{n}.tar"
        compared = self._exec(["sh", "-c", 'tar -d -f "$1" -C / 2>&1; exec tar -x -p -f "$1" -C /', "sh", archive],
                              "extracting the snapshot")
        differ: dict[str, str] = {}
        for line in compared.splitlines():
            path, _, why = line.partition(": ")
            if why and not path.startswith("tar"):
                differ.setdefault("/" + path.rstrip("/"), why)
        gone = {p for p, why in differ.items() if "No such file" in why}
        return Restored(
            changed=sorted({*(p for p in differ if p not in gone), *(p for p in from_image if now[p] == _CHANGED)}),
            removed=sorted(remove),
            recreated=sorted({*gone, *(p for p in from_image if now[p] == _DELETED)}),
        )

    def _restore_from_image(self, paths: list[str], now: dict[str, str]) -> None:
        # A deleted directory comes back whole; a changed one only as itself (its changed
        # children are listed on their own).
        args = []
        for p in paths:
            args += ["--recursion" if now[p] == _DELETED else "--no-recursion", p.lstrip("/")]
        from tmax.sandbox import podman_service

        url = podman_service.configured_url()
        podman = ["podman", *(["--url", url] if url else [])]
        archive = _run([*podman, "run", "--rm", "--network", "none", "--label", f"{LABEL_KEY}={LABEL_VALUE}",
                        "--entrypoint", "tar", self.image, "-c", "-f", "-", "-C", "/", *args],
                       f"reading the originals from {self.image}")
        if not self.box.container.put_archive("/", archive):
            raise SandboxError("undo: could not put the image's files back into the container")

    def drop(self, n: int) -> None:
        self._diffs.pop(n, None)
        self._dropped += [f"{SNAP_DIR}/{n}.tar", f"{SNAP_DIR}/{n}.list"]  # removed by the next save

    def close(self) -> None:
        self._diffs.clear()  # the snapshots go with the container


def snapshot_store(box: Sandbox) -> SnapshotStore:
    """The store for a started sandbox: its workspace (local, bwrap) or its container (podman)."""
    scope = box.capabilities.snapshot
    if scope == "container":
        return ContainerSnapshots(box)
    if scope == "jail":
        # Everything the jail can write: the workspace, its private /tmp and home.
        return SnapshotGroup([WatchedSnapshots(host, inside, JAIL_TMP_IGNORED if inside == "/tmp" else OWN_PREFIX)
                              for inside, host in box.writable_dirs()])
    if scope == "workdir":
        return WatchedSnapshots(Path(box.workdir))
    raise SandboxError(f"undo: a {box.kind} sandbox keeps no snapshots")
