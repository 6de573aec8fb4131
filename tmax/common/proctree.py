"""Processes tmax starts and must not leave behind: ending one with everything it started,
and tying a child to its parent's life; `end_orphans` finds what an owner that died left.

Every child that can fork (a sandbox command, an image build, a vLLM server and its
engine core, the podman service) ends through `end_process_tree`, and a child that must
die with its parent, even one SIGKILLed, gets `parent_death_hook` as its pre-exec hook.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import psutil

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _tree(pid: int) -> dict[int, psutil.Process]:
    """`pid`, its descendants, and the other members of the process group it leads (orphans
    whose parent exited stay in the group): collected before any signal, since a child
    whose parent dies is re-parented and no longer found below it."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        found[pid] = root
        found.update((c.pid, c) for c in root.children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    for other in psutil.pids():
        if other in found:
            continue
        try:
            if os.getpgid(other) == pid:
                found[other] = psutil.Process(other)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    found.pop(os.getpid(), None)  # a guard ending its own group outlives the signals it sends
    return found


def end_process_tree(pid: int, grace_s: float = 10.0) -> None:
    """End process `pid`, everything it started and, when it leads its own process group (a
    child started with `start_new_session=True`), whatever is left in that group: SIGTERM,
    then SIGKILL for what still runs after `grace_s` (SIGKILL at once when 0). Processes
    already gone are skipped; the calling process is never signalled."""
    _end(list(_tree(pid).values()), grace_s)


def _end(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL for what still runs after `grace_s` (at once when 0)."""
    if grace_s > 0:
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


class TreeCpu:
    """CPU seconds (user + system) spent so far by process `pid` (this one by default) and
    every descendant, each with the children it has reaped: what a run has spent on every
    core, less sensitive than its wall time to what else the machine runs.

    A descendant that exits unreaped by the tree (killed after its parent died, or
    re-parented outside it) would take its share with it, and a total that is read as a
    difference would fall: the learner or an engine ending mid-stage made a stage's CPU
    negative. So a thread samples the tree every `interval_s`, and a process gone since its
    last sample keeps what it had spent then, unless its parent is still in the tree (the
    parent reaped it: its share is in the parent's children times). It does not fall, unless
    a parent in the tree lets the kernel reap its children unrecorded (SIGCHLD ignored)."""

    def __init__(self, pid: int | None = None, interval_s: float = 1.0) -> None:
        self._pid = pid or os.getpid()
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._live: dict[tuple[int, float], tuple[int, float]] = {}  # (pid, start) -> (ppid, CPU s)
        self._departed = 0.0
        self._stop = threading.Event()
        self.read()
        self._thread = threading.Thread(target=self._sample_until_closed, name="tree-cpu", daemon=True)
        self._thread.start()

    def read(self) -> float:
        """The tree's CPU seconds now (a fresh sample)."""
        seen: dict[tuple[int, float], tuple[int, float]] = {}
        try:
            root = psutil.Process(self._pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    seen[(p.pid, p.create_time())] = (p.ppid(), t.user + t.system + t.children_user + t.children_system)
            except psutil.Error:  # ended since it was listed
                continue
        live_pids = {pid for pid, _ in seen}
        with self._lock:
            for key, (ppid, cpu) in self._live.items():
                if key not in seen and ppid not in live_pids:
                    self._departed += cpu
            self._live = seen
            return self._departed + sum(cpu for _, cpu in seen.values())

    def _sample_until_closed(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.read()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def parent_death_hook(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A pre-exec hook (Popen's `preexec_fn`) asking Linux to send the child `sig` when its
    parent dies, by SIGKILL too, where no exit handler runs. The kernel ties this to the
    *thread* that forked the child, so fork from a thread that lasts (the main thread, or
    `sandbox.hostexec.on_lasting_thread`). None where there is no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the hook ran
            os._exit(1)

    return hook


def _fresh_processes() -> Iterator[psutil.Process]:
    """Every process now, each a new `psutil.Process`. `process_iter` hands out objects it
    cached on an earlier call: one cached for a pid that has since been reused reads the new
    process's /proc but refuses to signal it (it takes it for the old one, gone)."""
    for pid in psutil.pids():
        try:
            yield psutil.Process(pid)
        except psutil.Error:
            continue


def end_orphans(env_key: str, scope: str, grace_s: float = 5.0) -> list[int]:
    """End the processes whose environment says `env_key` = "<scope>:<owner pid>" for an owner
    that is gone: what a SIGKILLed owner's children (and theirs) left running. Another
    scope, or a live owner, is left alone. SIGTERM, then SIGKILL after `grace_s`; returns
    the pids found."""
    found = []
    for p in _fresh_processes():
        try:
            value = p.environ().get(env_key, "")
        except psutil.Error:
            continue
        owner_scope, _, owner = value.rpartition(":")
        if owner_scope == scope and owner.isdigit() and p.pid != os.getpid() and not psutil.pid_exists(int(owner)):
            found.append(p)
    _end(found, grace_s)
    return [p.pid for p in found]
