"""Episodes as fresh overlays of a long-lived container, not fresh containers.

A host (`OverlayHost`) is a podman container of a task's image whose main process is the
episode helper (`sandbox/helper/`, bind-mounted in). An episode (`OverlaySandbox`) is a new
mount, pid, ipc and uts namespace in it (and a network namespace with only `lo` when the
task has no network) whose root is an overlay of the container's root with a fresh upper
layer: it starts from exactly the image's state, and everything it writes, starts or
changes goes when it ends. A container's creation, start and removal are paid once per
host; an episode costs a few process starts inside it (`benchmarks/podman_episode_profile.py`).

Limits: with the network shared (a task with `allow_internet`), or where episodes cannot
have cgroups of their own (`overlay_cgroup.supported`), a host serves one episode at a time
and the container's limits are the task's. Otherwise a host serves up to `capacity`
episodes at once, each in cgroups of its own with the task's memory, pids and CPU limits,
the container's being their sum. File-size limits (RLIMIT_FSIZE) and the seccomp profile
are the container's, inherited. The helper's own capabilities (CAP_SYS_ADMIN for mounts,
CAP_NET_ADMIN for an episode's loopback) are dropped from every set of the episode's
processes, and a seccomp filter refuses them namespace and mount syscalls.

The interface is `Sandbox`'s: the agent's persistent shell runs on a pty of this host whose
slave the helper hands to bash in the episode, `exec` is a process with pipes, files go in
and out through the episode's root fd, and the verifier runs in the same episode after the
agent, seeing exactly its state.

A fork (`OverlaySandbox.fork`) freezes the episode's upper layers as a read-only layer in the
host's state directory (`helper/layers.c`): the episode ends (its processes with it), and new
episodes stand on the frozen layer, each with a fresh upper layer of its own: the child at
once, the parent's continuation at the parent's next use (room for it kept meanwhile). What
either writes stays in its own upper layer; the frozen layer lives while an episode stands on
it. A chain of forks deeper than the helper's MAX_CHAIN is merged into one layer of hard
links. All are episodes of the host, with the task's limits and network rules, ended like any
other.

A task that is its base image plus files (`SandboxSpec.files`, a `base.FilesLayer`) needs no
image of its own: its episodes are overlays of a host of the base image, and the files are
written into each episode's fresh upper layer before its first command; its processes start
in the layer's WORKDIR. Every such task of one base image and limits shares the host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tmax.common.files import write_json_atomic
from tmax.common.waiting import wait_until
from tmax.sandbox import overlay_cgroup
from tmax.sandbox.base import AgentUserError, CommandResult, Forked, SandboxCapabilities, SandboxError, SandboxSpec
from tmax.sandbox.fork import ShellState
from tmax.sandbox.overlay_build import helper_binary
from tmax.sandbox.overlay_cgroup import EpisodeCgroup
from tmax.sandbox.overlay_files import copy_in, copy_out, write_layer
from tmax.sandbox.overlay_proto import (
    IN_BIN, IN_DIR, EpisodeLease, EpisodeSetupError, FrozenLayer, RemotePty, freeze, run_pipes,
)
from tmax.sandbox.podman import PodmanSandbox
from tmax.sandbox.shell import BASH_ARGV, PersistentShell
from tmax.sandbox.shell_sandbox import ShellSandbox

OVERLAY_LABEL = "io.tmax.overlay"  # on every host: the hash of what its episodes share
HELPER_PIDS = 16  # the container's own processes (init, helper, an episode's pid 1) beyond its episodes'
READY_TIMEOUT_S = 30.0


@dataclass
class HostInfo:
    """What an episode needs of its host; `host.json` in the host's state directory, so
    that any process of this machine can open episodes in it."""

    state_dir: str
    container_id: str
    name: str
    capacity: int
    own_net: bool  # each episode gets a network namespace of its own (the task has no network)
    cgroups: bool  # each episode gets cgroups of its own (several episodes at once)
    workdir: str  # the container's working directory: where the episode's shell starts
    started: float

    def save(self) -> None:
        write_json_atomic(Path(self.state_dir) / "host.json", asdict(self))

    @classmethod
    def load(cls, state_dir: Path) -> HostInfo | None:
        try:
            return cls(**json.loads((Path(state_dir) / "host.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None


class OverlayHost(PodmanSandbox):
    """The container of one image and set of limits whose episodes are overlays of it."""

    def __init__(self, spec: SandboxSpec, state_dir: Path, capacity: int = 1, idle_s: float = 120.0, **options):
        self.capacity = capacity
        self.idle_s = idle_s
        self.cgroups = capacity > 1
        cap = capacity if self.cgroups else 1
        host_spec = replace(spec, shell=False, name=None, user=None, labels=dict(spec.labels),
                            memory_mb=spec.memory_mb and spec.memory_mb * cap,
                            pids_limit=spec.pids_limit and spec.pids_limit * cap + HELPER_PIDS,
                            cpus=spec.cpus and spec.cpus * cap)
        super().__init__(host_spec, **options)
        self.binary = helper_binary()
        self.state_dir = Path(state_dir)
        self.own_net = not spec.network

    def main_command(self) -> list[str]:
        # The image's USER is whom the verifier and the harness's execs run as; the
        # container itself runs as root, for the helper's mounts.
        config = self.client.images.get(self.image).attrs.get("Config") or {}
        return ["serve", config.get("User") or "", str(self.capacity), str(int(self.idle_s))]

    def create_kwargs(self) -> dict:
        kw = super().create_kwargs()
        kw.update(entrypoint=[IN_BIN], user="0:0", cap_add=["SYS_ADMIN", "NET_ADMIN"], auto_remove=True)
        kw["mounts"] = [*kw.get("mounts", []),
                        {"type": "bind", "source": str(self.state_dir), "target": IN_DIR, "read_only": False},
                        {"type": "bind", "source": str(self.binary), "target": IN_BIN, "read_only": True}]
        return kw

    def start(self) -> HostInfo:  # type: ignore[override]
        super().start()
        ctl = self.state_dir / "ctl.sock"
        if not wait_until(lambda: ctl.exists() or not self._running(), READY_TIMEOUT_S, 0.02) or not ctl.exists():
            logs = self._logs()
            self.close()
            raise EpisodeSetupError(f"the episode helper did not start in {self.image}: {logs}")
        info = HostInfo(str(self.state_dir), self.container.id, self.name, self.capacity, self.own_net,
                        self.cgroups, self.workdir or "/", time.time())
        info.save()
        return info

    def _running(self) -> bool:
        try:
            self.container.reload()
            return self.container.status == "running"
        except Exception:
            return False

    def _logs(self) -> str:
        try:
            return b"".join(self.container.logs(stdout=True, stderr=True)).decode(errors="replace")[-2000:]
        except Exception as e:
            return f"(no logs: {e})"


def new_state_dir(parent: Path) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="h-", dir=parent))


def remove_state_dir(state_dir: Path) -> None:
    shutil.rmtree(state_dir, ignore_errors=True)


class OverlaySandbox(ShellSandbox):
    """One episode in a host: `Sandbox`'s interface over the episode helper."""

    kind = "podman"
    copy_is_cheap = True  # files go in through the episode's root fd, no call to podman

    def __init__(self, host: HostInfo, spec: SandboxSpec, lease: EpisodeLease, layer: FrozenLayer | None = None):
        """`layer`: the frozen layer the episode stands on (a fork's), holding its files."""
        self.host, self.spec, self.lease, self.layer = host, spec, lease, layer
        self.container_id = host.container_id  # where the episode ran (records name it)
        # A files layer's episode starts in its WORKDIR (its host is of the base image, whose
        # working directory is the base's); processes not told otherwise start there too, as
        # they would in a container of the built image.
        self.start_dir = spec.files.workdir if spec.files is not None else None
        self.workdir = self.start_dir or host.workdir
        self.cgroup: EpisodeCgroup | None = None
        self.shell: PersistentShell | None = None
        self._closed = False
        self._frozen: _Frozen | None = None  # forked, and not used since (`fork`, `_come_back`)
        # Forks need a second episode in the host: hosts of one episode at a time cannot.
        self.capabilities = SandboxCapabilities(overlay=True, fork=host.capacity > 1, limits=True, network=True,
                                                own_root=True)

    @property
    def mode(self) -> str:
        """How the episode was made, for records: "overlay" of a host of the task's image, or
        "overlay+files" of a host of its base image with the task's files written in."""
        return "overlay" if self.spec.files is None else "overlay+files"

    def start(self) -> None:
        """The episode's files layer (if any), its cgroups (several episodes at once in the
        host) and its shell."""
        s = self.spec
        try:
            if s.files is not None and self.layer is None:  # a fork's files are in its layer
                write_layer(self.lease.root_fd, s.files)
            if self.host.cgroups:
                self.cgroup = EpisodeCgroup(self.lease.peer_pid(), f"tmax-ep-{self.lease.id}", s.memory_mb,
                                            s.pids_limit, s.cpus)
            if s.shell:
                self._start_shell()
        except OSError as e:
            self.close()
            raise SandboxError(f"overlay episode: {e}") from e
        except BaseException:
            self.close()
            raise

    def _start_shell(self) -> None:
        self.shell = PersistentShell(BASH_ARGV, workdir=self.workdir, spawn=self._spawn)
        self.shell.start_vars = self.handover
        self.shell.after_start = self._after_start()
        self.shell.setup_in_env = True
        try:
            self.shell.start()
        except SandboxError as e:
            if self.spec.user and not isinstance(e, AgentUserError):
                raise AgentUserError(f"overlay episode: no shell as user {self.spec.user!r} in {self.workdir}: "
                                     f"{e}") from e
            raise

    def _spawn(self, argv: list[str], shell_vars: dict[str, str]) -> RemotePty:
        return RemotePty(self.lease.sock_path, argv, shell_vars, self.spec.user, cwd=self.start_dir)

    def exec(self, argv: list[str], timeout: float | None = None, workdir: str | None = None,
             env: dict[str, str] | None = None, user: str | None = None) -> CommandResult:
        self._come_back()
        if self._closed:
            raise SandboxError("sandbox is closed")
        return run_pipes(self.lease.sock_path, argv, timeout=timeout, cwd=workdir or self.start_dir, env=env,
                         user=self.spec.user if user is None else user)

    def _abs(self, p: str) -> str:
        return p if p.startswith("/") else os.path.join(self.workdir or "/", p)

    def copy_in(self, src: Path, dst: str) -> None:
        self._come_back()
        if not Path(src).exists():
            raise SandboxError(f"copy_in: {src} does not exist")
        copy_in(self.lease.root_fd, Path(src), self._abs(dst))

    def copy_out(self, src: str, dst: Path) -> None:
        self._come_back()
        copy_out(self.lease.root_fd, self._abs(src), Path(dst))

    def fork(self) -> Forked:
        """A child episode on this one's files, frozen. This one's episode ends (its processes with
        it: named in the record) and comes back as a new episode on the same files at its next
        use (`_come_back`): a parent only forked, never used again, costs no second episode, and
        forking it again costs the child alone."""
        if not self.capabilities.fork:
            raise SandboxError("this overlay host serves one episode at a time (shared network, or no cgroups "
                               "per episode): its episodes cannot fork")
        if self._frozen is not None:  # frozen by an earlier fork, and not used since: that is its state
            t0, frozen = time.monotonic(), self._frozen
            return self._forked(self._episode_on(frozen.layer, frozen.state, self._lease(frozen.layer, False)),
                                frozen.state, [], t0, layers=frozen.layer.depth)
        if self.host.cgroups:
            overlay_cgroup.warm_migrations()  # the child's cgroups join sooner
        t0, state, background = self._fork_state()
        listener = self._shell().on_output
        layer = freeze(Path(self.host.state_dir), self.lease.id, 2)  # HostBusy: nothing changed
        # What this process holds of the ended episode goes while the child starts (its wait for
        # its cgroups and its shell's answer leave time for it).
        ending = threading.Thread(target=self._end_episode, name="tmax-fork-parent-end", daemon=True)
        ending.start()
        self._frozen = _Frozen(layer, state, listener)  # its room kept until it comes back
        try:
            try:
                lease = self._lease(layer, True)  # takes the child's room
            except BaseException:
                layer.drop()  # the child's room, not taken
                raise
            # A child that fails from here on ends its episode, and its room with it: the
            # parent's stays kept.
            child = self._episode_on(layer, state, lease)
        finally:
            ending.join()
        return self._forked(child, state, background, t0, layers=layer.depth)

    def _episode_on(self, layer: FrozenLayer, state: ShellState, lease: EpisodeLease) -> OverlaySandbox:
        """The new episode `lease` of this host on `layer`, started (closed if that fails), its
        shell to take `state`."""
        child = OverlaySandbox(self.host, self.spec, lease, layer)
        child._handing_over(state)
        child.start()
        return child

    def _come_back(self) -> None:
        """A parent frozen by `fork`, at its next use: a new episode on its layer, in the room
        kept for it, its shell on its state."""
        frozen, self._frozen = self._frozen, None
        if frozen is None:
            return
        if self.host.cgroups:
            overlay_cgroup.warm_migrations()
        try:
            self.lease, self.layer, self._closed = self._lease(frozen.layer, True), frozen.layer, False
            self._handing_over(frozen.state)
            self.start()
            self._restored(frozen.state)
            self._shell().on_output = frozen.listener
        finally:
            frozen.layer.release()  # its room taken, or given back

    def _shell(self) -> PersistentShell:
        self._come_back()
        return super()._shell()

    def _lease(self, layer: FrozenLayer, held: bool) -> EpisodeLease:
        return EpisodeLease(Path(self.host.state_dir), secrets.token_hex(6), self.host.own_net, layer=layer.id,
                            held=held)

    def _process_root(self) -> int | None:
        return self.lease.peer_pid()  # the episode's pid 1

    def _end_episode(self) -> None:
        """What this process holds of an ended episode: its shell, lease (the root's fd) and cgroups."""
        self._close_shell()
        self.lease.close()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        self._closed = True

    def close(self) -> None:
        """End the episode: its processes are killed with its pid namespace, its upper layer
        goes, its cgroups are removed. The host lives on."""
        if self._frozen is not None:
            self._frozen.layer.release()  # the room kept for it
            self._frozen = None
        if self._closed:
            return
        self._end_episode()


@dataclass
class _Frozen:
    """A forked episode's parent until it comes back: its layer (and kept room), shell state and
    output listener."""

    layer: FrozenLayer
    state: ShellState
    listener: Callable[[str], None] | None


def cgroups_possible(spec: SandboxSpec) -> bool:
    """Whether episodes of `spec` can share a host: each needs a network namespace of its own
    (no network) and cgroups of its own."""
    return not spec.network and overlay_cgroup.supported()
