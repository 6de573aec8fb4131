"""Episodes of long-lived containers (`sandbox.overlay`), shared by a machine's processes.

`OverlayPool` is a `sandbox.pool.SandboxPool`, as `WarmPool` is, so episodes take it wherever
they took a pool of fresh containers (`sandbox.pool.make_pool` picks it). What it
hands out is a fresh episode in a host of the episode's image and limits: a host already
running on this machine (any process's: rollout workers on one node share theirs) when
one has room, else one it starts. A host is a state directory under the registry's root
(`<root>/<key>/h-*`) holding its helper's socket and `host.json`; hosts end themselves
after `idle_s` without episodes (the container removed with them), and a pool asks the
hosts it started to end at its close when they are idle.

An episode of a files layer (`SandboxSpec.files`: a task that is its base image plus files)
is an overlay of a host of the base image, with the files written in (`sandbox.overlay`):
one host serves every such task of that base image and those limits.

What the overlay cannot serve falls back to a fresh container per episode, with a warning
naming why, counted in `fallbacks`: a sandbox with a host directory mounted writable (its
writes would outlive the episode), a machine without a C compiler for the helper, and an
image whose container refused the helper's mounts. A files layer's fallback, and one whose
files could not be written, is a container of the task's built image
(`SpecFactory.own_image`, built then).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from tmax.common.files import cache_dir
from tmax.common.waiting import wait_until
from tmax.sandbox.base import Forked, Sandbox, SandboxCapabilities, SandboxError, SandboxSpec
from tmax.sandbox.overlay import OVERLAY_LABEL, HostInfo, OverlayHost, OverlaySandbox, cgroups_possible
from tmax.sandbox.overlay_build import HelperUnavailable, helper_binary
from tmax.sandbox.overlay_files import FilesLayerError
from tmax.sandbox.overlay_proto import EpisodeLease, EpisodeSetupError, HostBusy, HostGone, connect_unix, quit_host
from tmax.sandbox.pool import SpecFactory, WarmPool

log = logging.getLogger(__name__)

DEFAULT_IDLE_S = 120.0
STALE_START_S = 120.0  # a state directory without a helper this long after its start is a dead host's


def remove_dir(d: Path) -> None:
    """A host's state directory, once its helper has ended: with the layers of episodes a
    killed container left (no mount of theirs outlives the container)."""
    shutil.rmtree(d, ignore_errors=True)


def host_spec(spec: SandboxSpec) -> SandboxSpec:
    """What the host of episodes of `spec` is made of: for a files layer, a container of the
    base image (its own working directory; each episode starts in the layer's)."""
    return spec if spec.files is None else replace(spec, files=None, workdir=None)


def host_key(spec: SandboxSpec, labels: dict[str, str]) -> str:
    """What hosts of episodes of `spec` have in common, hashed: the image, working
    directory, network, limits, environment, mounts, the hosts' labels and the helper;
    every files layer of one base image (and limits) has the base image's key."""
    spec = host_spec(spec)
    what = [spec.image, spec.workdir, spec.network, spec.cpus, spec.memory_mb, spec.pids_limit, spec.storage_mb,
            sorted(spec.env.items()), sorted(spec.mounts), sorted(labels.items()), helper_binary().name]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:20]


class HostRegistry:
    """This machine's hosts, per key: state directories under `root` (default: tmax's cache,
    `eph/`), which must be this user's alone: a socket planted there by another would be
    handed this process's files."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root or cache_dir() / "eph")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise HelperUnavailable(f"{self.root} is not this user's alone (owner {st.st_uid}, mode "
                                    f"{oct(st.st_mode & 0o777)}): no shared containers")

    def hosts(self, key: str) -> list[Path]:
        return sorted((self.root / key).glob("h-*"))

    def live(self, key: str) -> bool:
        return any((d / "ctl.sock").exists() for d in self.hosts(key))

    def lease(self, key: str) -> tuple[HostInfo, EpisodeLease] | None:
        """A new episode in a host of `key` that has room; None when none has."""
        for d in self.hosts(key):
            info = HostInfo.load(d)
            if info is None:
                self.forget_if_stale(d, None)
                continue
            try:
                return info, EpisodeLease(d, secrets.token_hex(6), info.own_net)
            except HostBusy:
                continue
            except HostGone:
                self.forget_if_stale(d, info)
        return None

    def forget_if_stale(self, d: Path, info: HostInfo | None) -> None:
        """Remove the directory of a host whose helper is gone (idle end, a kill); one without
        host.json is still starting, unless it is older than any start. A helper that still
        takes connections is live whatever its last answer was (an episode of it that died
        in its setup): its directory holds the sockets and layers of its other episodes."""
        try:
            if info is None and time.time() - d.stat().st_mtime < STALE_START_S:
                return
        except OSError:
            return
        if not helper_answers(d):
            remove_dir(d)

    @contextmanager
    def starting(self, key: str) -> Iterator[None]:
        """Held while a host of `key` starts: one start per key at a time on this machine."""
        (self.root / key).mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class OverlayPool:
    """Fresh episodes in shared long-lived containers; fresh containers for the rest."""

    def __init__(self, slots: int, ahead: int = 0, host_labels: dict[str, str] | None = None,
                 idle_s: float = DEFAULT_IDLE_S, root: Path | None = None, close_in_background: bool = True):
        self.slots = max(1, slots)  # episodes at once in a host this pool starts (with cgroups)
        # As `WarmPool.capacity`: the running episodes and those started ahead (what
        # `sandbox.pool.WarmAhead` fills up to); here a host each, unless one is running.
        self.capacity = self.slots + max(0, ahead)
        self.host_labels = dict(host_labels or {})
        self.idle_s = idle_s
        try:
            self.registry: HostRegistry | None = HostRegistry(root)
            self._unavailable: str | None = None
        except (OSError, HelperUnavailable) as e:
            self.registry, self._unavailable = None, str(e)
        self.close_in_background = close_in_background
        self.fallback = WarmPool(max(1, slots) + ahead, close_in_background)
        self._lock = threading.Lock()
        self._in_use: dict[int, OverlaySandbox] = {}
        self._started: list[HostInfo] = []  # the hosts this pool started
        self._broken: dict[str, str] = {}  # host key -> why its episodes fall back
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.warm_hits = 0  # episodes in a host that was already running
        self.episodes = 0
        self.hosts_started = 0
        self.fallbacks: dict[str, int] = {}

    @property
    def cold_starts(self) -> int:
        """Episodes that had to start their host (`warm_hits` found one running)."""
        return self.episodes - self.warm_hits

    # -- what the overlay serves ------------------------------------------------------

    def unsupported(self, spec: SandboxSpec | None, key: str | None) -> str | None:
        """Why episodes of `spec` (of host key `key`, when known) take a fresh container each;
        None when the overlay serves them."""
        if spec is None or spec.image is None:
            return "not a podman sandbox"
        if spec.workspace is not None:
            return "a host workspace is mounted: its writes would outlive the episode"
        if any(not ro for _host, _target, ro in spec.mounts):
            return "a host directory is mounted writable: its writes would outlive the episode"
        if self._unavailable:
            return self._unavailable
        try:
            helper_binary()
        except HelperUnavailable as e:
            return str(e)
        return self._broken.get(key or "")

    def _fall_back(self, why: str) -> None:
        with self._lock:
            first = why not in self.fallbacks
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        if first:
            log.warning("episodes in a fresh container each (not an overlay of a shared one): %s", why)

    # -- episodes ---------------------------------------------------------------------

    def acquire(self, key: Hashable, factory: SpecFactory, timeout: float | None = None) -> Sandbox:
        spec = getattr(factory, "spec", None)
        why = self.unsupported(spec, None)
        hkey = host_key(spec, self.host_labels) if why is None else ""
        why = why or self._broken.get(hkey)
        if why is None:
            try:
                return self._episode(hkey, spec)
            except (EpisodeSetupError, HelperUnavailable) as e:
                why = self._broken.setdefault(hkey, f"the overlay failed in {spec.image}: {e}")
            except FilesLayerError as e:  # this task's files, not the host: its episodes are built
                why = f"a files layer could not be written: {e}"
        self._fall_back(why)
        return self.fallback.acquire(key, factory, timeout)

    def _episode(self, hkey: str, spec: SandboxSpec) -> OverlaySandbox:
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        got = self.registry.lease(hkey)
        warm = got is not None
        while got is None:
            with self.registry.starting(hkey):
                got = self.registry.lease(hkey)
                if got is None:
                    self._start_host(hkey, host_spec(spec))
                    got = self.registry.lease(hkey)
        info, lease = got
        sb = OverlaySandbox(info, spec, lease)
        sb.start()  # closes itself (ending the episode) if it fails
        with self._lock:
            self._in_use[id(sb)] = sb
            self.episodes += 1
            self.warm_hits += warm
        return sb

    def _start_host(self, hkey: str, spec: SandboxSpec) -> HostInfo:
        """A new host of `hkey` (the caller holds the key's start lock)."""
        capacity = self.slots if cgroups_possible(spec) else 1
        labels = {**self.host_labels, OVERLAY_LABEL: hkey}
        host_spec = replace(spec, labels=labels, name=None)
        state_dir = self.registry.root / hkey
        state_dir.mkdir(parents=True, exist_ok=True)
        state_dir = Path(tempfile.mkdtemp(prefix="h-", dir=state_dir))
        host = OverlayHost(host_spec, state_dir, capacity=capacity, idle_s=self.idle_s)
        try:
            info = host.start()
        except BaseException:
            remove_dir(state_dir)
            raise
        with self._lock:
            self._started.append(info)
            self.hosts_started += 1
        return info

    def prewarm(self, key: Hashable, factory: SpecFactory) -> bool:
        """Start a host for a coming episode of `factory.spec` (in the background) unless this
        machine runs one already; False when nothing was started."""
        spec = getattr(factory, "spec", None)
        why = self.unsupported(spec, None)
        hkey = host_key(spec, self.host_labels) if why is None else ""
        if why or hkey in self._broken:
            return self.fallback.prewarm(key, factory)
        if self._closed or self.registry.live(hkey):
            return False

        def work() -> None:
            try:
                with self.registry.starting(hkey):
                    if not self.registry.live(hkey) and not self._closed:
                        self._start_host(hkey, host_spec(spec))
            except (EpisodeSetupError, HelperUnavailable) as e:
                self._broken.setdefault(hkey, f"the overlay failed in {spec.image}: {e}")
            except Exception:
                pass  # the episode that comes starts its own, and reports what goes wrong

        self._spawn(work, "tmax-overlay-warm")
        return True

    def capabilities(self, factory: SpecFactory | None = None) -> SandboxCapabilities:
        """What the sandboxes `acquire(key, factory)` hands out can do: an overlay episode forks
        where its host serves several episodes at once (this pool's hosts, with `slots` > 1).
        Without a factory: what its overlay episodes can do (a spec they cannot serve gets a
        container of its own instead)."""
        if factory is None:
            return SandboxCapabilities(overlay=True, fork=self.slots > 1, limits=True, network=True, own_root=True)
        spec = getattr(factory, "spec", None)
        why = self.unsupported(spec, None)
        if why is not None or host_key(spec, self.host_labels) in self._broken:
            return self.fallback.capabilities(factory)
        return SandboxCapabilities(overlay=True, fork=self.slots > 1 and cgroups_possible(spec), limits=True,
                                   network=True, own_root=True)

    def fork(self, sb: Sandbox) -> Forked:
        """`sb.fork()` for a sandbox handed out by `acquire`; the child is this pool's too."""
        with self._lock:
            mine = id(sb) in self._in_use
        if not mine:
            return self.fallback.fork(sb)
        forked = sb.fork()
        with self._lock:
            self._in_use[id(forked.sandbox)] = forked.sandbox
        return forked

    def release(self, sb: Sandbox) -> None:
        """End an episode handed out by `acquire` (its host lives on), or close a fallback's
        container."""
        with self._lock:
            mine = self._in_use.pop(id(sb), None)
        if mine is None:
            self.fallback.release(sb)
        elif self.close_in_background:
            self._spawn(mine.close, "tmax-overlay-close")
        else:
            mine.close()

    def _spawn(self, fn, name: str) -> None:
        t = threading.Thread(target=fn, daemon=True, name=name)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until the hosts being started ahead are up (or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in list(self._threads):
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.fallback.wait_warm(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self, in_use: bool = False) -> None:
        """End this pool: its episodes still in use with `in_use`, then every host it started
        that no episode uses (others end when idle)."""
        self._closed = True
        with self._lock:
            busy = list(self._in_use.values()) if in_use else []
            threads = list(self._threads)
        for sb in busy:
            sb.close()
        for t in threads:
            t.join(timeout=120)
        self._end_hosts()
        self.fallback.close(in_use)

    def _end_hosts(self, wait_s: float = 30.0) -> None:
        """Ask every host this pool started to end once idle, and wait (at most `wait_s`) until
        podman has removed those that did: a job's containers are gone when it ends."""
        from tmax.sandbox import podman_service

        ending = [h for h in self._started if quit_host(Path(h.state_dir))]
        if not ending:
            return
        with podman_service.client() as client:
            def gone() -> bool:
                try:
                    return not any(client.containers.exists(h.container_id) for h in ending)
                except Exception:  # no service to ask (a Ctrl-C reached it too): the CLI
                    return not any(_exists(h.container_id) for h in ending)

            wait_until(gone, wait_s, 0.1)
        for h in ending:
            if not (Path(h.state_dir) / "ctl.sock").exists():
                remove_dir(Path(h.state_dir))

    def stats(self) -> dict[str, object]:
        return {"episodes": self.episodes, "warm_hits": self.warm_hits, "hosts_started": self.hosts_started,
                "fallbacks": dict(self.fallbacks)}

    def __enter__(self) -> OverlayPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exists(container_id: str) -> bool:
    """Whether podman still has the container (asked through its CLI); True when unsure."""
    try:
        return subprocess.run(["podman", "container", "exists", container_id], capture_output=True,
                              timeout=60).returncode != 1
    except (OSError, subprocess.TimeoutExpired):
        return True


def remove_host_dirs(root: Path | None = None) -> list[str]:
    """State directories of hosts that are gone (for `tmax sandbox clean`)."""
    try:
        reg = HostRegistry(root)
    except (OSError, HelperUnavailable):
        return []
    removed = []
    for key_dir in sorted(reg.root.glob("*")):
        if not key_dir.is_dir():
            continue
        for d in reg.hosts(key_dir.name):
            reg.forget_if_stale(d, HostInfo.load(d))
            if not d.exists():
                removed.append(str(d))
        if not any(key_dir.iterdir()):  # no host of this key left: its lock goes too
            key_dir.rmdir()
            (reg.root / f"{key_dir.name}.lock").unlink(missing_ok=True)
    return removed


def helper_answers(state_dir: Path) -> bool:
    """Whether a helper listens on the host's socket: no socket, or a refused connect, says it
    is gone; a full backlog or a slow accept (a busy machine) says it is there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            connect_unix(s, state_dir / "ctl.sock")
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:
            pass  # busy, not gone
        return True

