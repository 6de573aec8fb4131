"""The one interface every sandbox backend implements.

A sandbox is a place to run commands: the host (`local`), a bubblewrap jail (`bwrap`)
or a podman container (`podman`). Each owns one persistent bash session
(`sandbox.shell.PersistentShell`) for the agent's commands, plus a one-off `exec` for
harness work (setup scripts, verifiers) that must not disturb the agent's shell state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, get_args, runtime_checkable

from pydantic import BaseModel, ConfigDict

# Every resource tmax creates carries this label (podman) or name prefix, so
# `tmax sandbox clean` can find leftovers of crashed runs.
# The sandbox kinds, defined here only: configs type a kind as `SandboxKind`.
SandboxKind = Literal["local", "bwrap", "podman"]
KINDS: tuple[str, ...] = get_args(SandboxKind)
HOST_KINDS = ("bwrap", "local")  # no image: the agent works in a fresh host workspace

LABEL_KEY = "io.tmax.managed"
LABEL_VALUE = "1"
NAME_PREFIX = "tmax-"

DEFAULT_COMMAND_TIMEOUT_S = 120.0

# `exec(..., user=IMAGE_USER)` runs as the image's own USER (the harness's identity, e.g.
# root for a verifier that writes /logs), not as the agent's user.
IMAGE_USER = ""


class SandboxError(RuntimeError):
    """Infrastructure failure of a sandbox (could not start, died, lost its shell).

    Callers label these as infrastructure errors; they are never the agent's fault."""


class AgentUserError(SandboxError):
    """The image does not let the agent's user (`SandboxSpec.user`) open its shell: no such
    user, or the workdir is closed to it. The task's environment is at fault."""


@dataclass
class CommandResult:
    output: str  # what the command printed (a pty merges stdout and stderr)
    exit_code: int  # the command's real exit code; 124 on timeout
    timed_out: bool = False
    # Harness notes for the observation, e.g. "the shell exited and was restarted".
    note: str | None = None
    duration_s: float = 0.0
    # Set when output was cut while reading (bounded memory): characters dropped.
    dropped_chars: int = 0
    stderr: str = ""  # only `exec` separates stderr; the pty shell cannot


@dataclass(frozen=True)
class LayerCopy:
    """One COPY of a files layer: host `sources` (files or directories) to `dest` inside.
    A directory's contents go into `dest`; a file goes into `dest` when `into` (the COPY's
    destination ended with "/", or it named several sources) or when `dest` is a directory
    inside, else it becomes `dest`."""

    sources: tuple[str, ...]  # absolute host paths
    dest: str  # absolute path inside
    into: bool = False


@dataclass(frozen=True)
class LayerDir:
    """A WORKDIR of a files layer: the directory, with its missing parents, made (mode 755,
    root) unless it exists."""

    path: str  # absolute path inside


@dataclass(frozen=True)
class FilesLayer:
    """An environment that is an image plus files, served without building an image: an
    episode of a container of `SandboxSpec.image` (the base image) whose fresh root gets
    `steps` (the Dockerfile's COPY and WORKDIR instructions, in order) before its first
    command, as `podman build` would have made them: contents, modes and file mtimes of
    the sources (mtimes to the nearest second), owner root, directories the copy needs made.
    The episode's shell and processes start in `workdir`."""

    steps: tuple[LayerCopy | LayerDir, ...]
    workdir: str


@dataclass
class SandboxSpec:
    """What to create. Backends ignore fields that do not apply to them."""

    image: str | None = None  # podman image
    workdir: str | None = None  # initial cwd of the shell; default: image WORKDIR / host cwd
    workspace: Path | None = None  # host directory bind-mounted (podman) or made writable (bwrap)
    workspace_target: str | None = None  # where the workspace appears inside; default same path
    network: bool = False
    cpus: float | None = None
    memory_mb: int | None = None  # podman: memory and memory+swap cap (the cgroup OOM-kills past it)
    pids_limit: int | None = 4096  # podman: processes and threads at once (fork fails past it)
    # podman: the largest file any process inside may write (RLIMIT_FSIZE; past it the write
    # fails with EFBIG / SIGXFSZ). podman can cap the whole writable layer only on XFS.
    storage_mb: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (host, target, read_only)
    name: str | None = None
    # The agent's user (name or UID) in a podman container: its shell and every `exec` not
    # told otherwise run as it. None: the image's USER. Host sandboxes cannot switch user
    # and run as the invoking user whatever this says.
    user: str | None = None
    # bwrap: host paths hidden in the jail on top of the usual credential files, and
    # paths of that default list to show after all.
    masked: list[str] = field(default_factory=list)
    exposed: list[str] = field(default_factory=list)
    # podman: start the agent's persistent shell. False for agents that only exec and copy
    # (the oracle, nop): the container is ready without paying for a shell nobody types in.
    shell: bool = True
    # podman, overlay episodes only (`sandbox.overlay_pool`): the files written into each
    # episode's root on top of `image`, the base image. Nothing else serves it: a container of
    # its own needs the task's built image (`overlay_pool.SpecFactory.own_image`).
    files: FilesLayer | None = None


# What an undo snapshot of a sandbox covers (`SandboxCapabilities.snapshot`).
SnapshotScope = Literal["container", "jail", "workdir"]


class SandboxCapabilities(BaseModel):
    """What a sandbox (or the sandboxes a pool hands out for a spec) can do beyond the
    `Sandbox` interface every backend has. Callers read this, never the sandbox's kind."""

    model_config = ConfigDict(frozen=True)

    overlay: bool = False
    """An episode is a fresh overlay of a long-lived container shared with other episodes
    (`sandbox.overlay`): a task that is its base image plus files (`SandboxSpec.files`) is
    served unbuilt, its files written into the episode's root."""
    fork: bool = False
    """`fork()`: a child sandbox in the parent's state (files, cwd, exported variables, shell
    functions and aliases), isolated from it and from its siblings (`sandbox.fork`)."""
    snapshot: SnapshotScope | None = None
    """What `/undo` snapshots track (`sandbox.snapshot.snapshot_store`): the container's whole
    filesystem, every place a jail can write, or the working directory alone; None: no undo."""
    limits: bool = False
    """The spec's cpus, memory, pids and file size limits are enforced (a host sandbox runs
    with the invoking user's)."""
    network: bool = False
    """`SandboxSpec.network = False` cuts the network (a namespace with only `lo`)."""
    workspace_target: bool = False
    """The host workspace appears inside at `SandboxSpec.workspace_target` (a bind mount);
    False: at its host path."""
    own_root: bool = False
    """A root filesystem of its own (a container's): a path such as /solution is the
    sandbox's alone and goes with it; False: the host's files, or a jail over them."""


class BackgroundProcess(BaseModel):
    """A process other than the shell that was running in a sandbox when it was forked: not
    carried into the child (a fork copies state, not processes)."""

    pid: int  # as the sandbox sees it (its own pid namespace, if it has one)
    command: str


class ForkRecord(BaseModel):
    """What a fork carried and what it could not."""

    kind: str
    cwd: str  # the child's working directory
    exported: list[str]  # names of the exported variables carried
    functions: list[str]  # shell functions carried (the harness's own left out)
    aliases: list[str]
    background: list[BackgroundProcess]  # running in the parent at the fork: not in the child
    workdir: str | None = None  # the child's working directory as its spec names it (a local fork's copy)
    layers: int = 0  # overlay: frozen layers under the child (deeper chains are merged)
    seconds: float = 0.0


@dataclass
class Forked:
    """A child sandbox (started, its shell on the parent's state) and its fork's record."""

    sandbox: Sandbox
    record: ForkRecord


@runtime_checkable
class Sandbox(Protocol):
    kind: str  # "local" | "bwrap" | "podman"
    copy_is_cheap: bool  # `copy_in` costs no more than a process start inside (no API call)
    capabilities: SandboxCapabilities

    def start(self) -> None: ...

    def run(self, command: str, timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S) -> CommandResult:
        """Run one command in the persistent shell (state carries over)."""
        ...

    def interrupt(self, force: bool = False) -> None:
        """Send Ctrl-C to the command running in the persistent shell (thread-safe); with
        `force`, SIGKILL its whole process group at once."""
        ...

    def exec(
        self,
        argv: list[str],
        timeout: float | None = None,
        workdir: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
    ) -> CommandResult:
        """Run a one-off process outside the agent's shell, stdout and stderr separate; as
        `user` (podman), by default the agent's user, IMAGE_USER for the image's USER."""
        ...

    def copy_in(self, src: Path, dst: str) -> None:
        """Copy a host file or directory to `dst` inside (dst is the target path)."""
        ...

    def copy_out(self, src: str, dst: Path) -> None: ...

    def fork(self) -> Forked:
        """A child in this sandbox's state, where `capabilities.fork` says so (SandboxError
        elsewhere); the child is the caller's to close."""
        ...

    def close(self) -> None:
        """Destroy everything the sandbox created. Idempotent."""
        ...
