"""One episode of a task: environment -> sandbox -> (the caller's agent) -> verifier.

The single path by which both `tmax bench` trials (`tasks.trial`: episode + Harbor
records) and `tmax learn` rollouts (`training.rollout`: episode + token trace) run a
task:

* the environment is the task's image (`tasks.task_images`, with the offline rewrites and
  patches) on podman, or a fresh host workspace (`tasks.hostenv`) on bwrap / local; a task
  that is its base image plus files is not built where its episodes are overlays of shared
  containers (`EnvSettings.files_layer` and a pool with the `overlay` capability): a container of the base image
  serves it, the files written into each episode (`tasks.files_layer`), and it is built,
  then, only for a container of its own (the pool's fallback);
* the sandbox gets the task's limits from task.toml (cpus, memory, pids, storage as a
  per-file cap, network only with `allow_internet`; docs/DESIGN.md "Limits") and its
  `[agent] user`, the same for bench and learn: on podman the agent's shell and execs run
  as that user while the verifier keeps the image's USER (or `[verifier] user`); host
  sandboxes run as the invoking user, and bwrap applies only the network setting;
* the task's `tests/` enter the sandbox only when the verifier runs, after the agent.

`prepare_environments` resolves (builds) every task's environment up front, so a run
learns before it starts which tasks cannot run, and why.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tmax.sandbox.base import ForkRecord, Sandbox, SandboxError, SandboxSpec
from tmax.sandbox.pool import SandboxPool, SpecFactory
from tmax.tasks.hostenv import HOST_KINDS, HostEnv, HostEnvError, check_dockerfile
from tmax.tasks.hostenv import prepare as prepare_host
from tmax.tasks.task_images import ImageBuildError, TaskImage, ensure_image
from tmax.tasks.task_format import Task
from tmax.tasks.offline import RewriteConfig
from tmax.tasks.verifier import VerifierKind, VerifierOutcome, run_host_verifier, run_verifier

ENVIRONMENT_ERRORS = (ImageBuildError, HostEnvError)


@dataclass
class EnvSettings:
    """How episodes get their environment; shared by all episodes of a job or run."""

    kind: str = "podman"  # podman | bwrap | local
    rewrite: RewriteConfig = field(default_factory=RewriteConfig)
    use_prebuilt: bool = True
    override_cpus: float | None = None
    override_memory_mb: int | None = None
    # Labels every sandbox carries (a training run's id, so its leftovers can be found).
    labels: dict[str, str] = field(default_factory=dict)
    # podman, episodes as overlays of shared containers: a task that is its base image plus
    # files is resolved as those, unbuilt (`tasks.files_layer`).
    files_layer: bool = False


def sandbox_spec(task: Task, settings: EnvSettings, image: TaskImage | None, host: HostEnv | None,
                 name: str | None = None, labels: dict[str, str] | None = None) -> SandboxSpec:
    """The sandbox of one episode, with the task's limits from task.toml."""
    ecfg = task.config.environment
    if host is not None:
        return host.spec(network=ecfg.allow_internet, name=name, labels=labels)
    assert image is not None
    return SandboxSpec(
        image=image.run_image, workdir=image.workdir, network=ecfg.allow_internet,
        cpus=settings.override_cpus or ecfg.cpus, memory_mb=settings.override_memory_mb or ecfg.memory_mb,
        pids_limit=ecfg.pids_limit, storage_mb=ecfg.storage_mb, env=dict(settings.rewrite.ca_env),
        mounts=list(settings.rewrite.ca_mount), labels=dict(labels or {}), name=name, user=task.config.agent.user,
        files=image.files,
    )


def pool_key(spec: SandboxSpec) -> tuple:
    """Episodes whose sandboxes are interchangeable before the agent starts share a key."""
    return (spec.image, spec.workdir, spec.network, spec.cpus, spec.memory_mb, spec.pids_limit, spec.storage_mb,
            spec.user, spec.shell, tuple(sorted(spec.labels.items())), spec.files)


def resolve_environment(task: Task, settings: EnvSettings, cancel: threading.Event | None = None) -> TaskImage | None:
    """The task's image (built if needed, unless `settings.files_layer` finds it a files
    layer) on podman; on a host kind, None once the task is known to run there. Raises
    ImageBuildError / HostEnvError."""
    if settings.kind in HOST_KINDS:
        check_dockerfile(task)
        return None
    return ensure_image(task, settings.rewrite, use_prebuilt=settings.use_prebuilt, files_layer=settings.files_layer,
                        cancel=cancel)


class Episode:
    """One task's fresh environment for one episode.

        with Episode(task, settings) as ep:
            sandbox = ep.open()          # started, limits applied, no tests/ inside
            ... the agent runs in `sandbox`, starting in `ep.workdir` ...
            result = ep.verify(out_dir, timeout)

    `image` is the task's already resolved image (otherwise it is resolved here); `pool`
    (a `sandbox.pool.SandboxPool`: an episode of a shared container, or a container started
    ahead of need) hands it out; `shell=False`
    starts no persistent shell (for agents that only exec and copy)."""

    def __init__(self, task: Task, settings: EnvSettings, *, image: TaskImage | None = None, pool: SandboxPool | None = None,
                 name: str | None = None, labels: dict[str, str] | None = None,
                 on_sandbox: Callable[[Any], None] | None = None, cancel: threading.Event | None = None,
                 shell: bool = True):
        self.task, self.settings, self.image, self.pool = task, settings, image, pool
        self.shell = shell  # whether the agent needs the sandbox's persistent shell
        self.name, self.on_sandbox, self.cancel = name, on_sandbox, cancel
        self.labels = {**settings.labels, **(labels or {})}
        self.host: HostEnv | None = None
        self.sandbox: Sandbox | None = None
        self.workdir = ""
        self.warm = False  # the sandbox came started from the pool

    @property
    def host_kind(self) -> bool:
        return self.settings.kind in HOST_KINDS

    @property
    def serves_files(self) -> bool:
        """Whether a task that is its base image plus files runs as that, unbuilt: only in
        overlay episodes, and when the settings ask for it."""
        return self.settings.files_layer and self.pool is not None and self.pool.capabilities().overlay

    def spec(self) -> SandboxSpec:
        spec = sandbox_spec(self.task, self.settings, self.image, self.host, self.name, self.labels)
        spec.shell = self.shell
        return spec

    def open(self) -> Sandbox:
        """Resolve the environment and start the sandbox. ImageBuildError, HostEnvError and
        SandboxError are the environment's failures (infrastructure)."""
        from tmax.sandbox import make_sandbox

        if self.host_kind:
            self.host = prepare_host(self.task, self.settings.kind)
            self.workdir = self.host.workdir
        else:
            if self.image is None or (self.image.files is not None and not self.serves_files):
                self.image = self._own_image(files_layer=self.serves_files)
            self.workdir = self.image.workdir
        if self.cancel is not None and self.cancel.is_set():
            # Interrupted during the build: start no container the interrupt can no longer see.
            raise SandboxError("cancelled before the sandbox started")
        spec = self.spec()
        if self.pool is not None and not self.host_kind:
            spec.name = None  # pooled containers name themselves: they are started ahead
            hits = self.pool.warm_hits
            self.sandbox = self.pool.acquire(pool_key(spec), self._factory(spec))
            self.warm = self.pool.warm_hits > hits
        else:
            self.sandbox = make_sandbox(self.settings.kind, spec)
            if self.on_sandbox:
                self.on_sandbox(self.sandbox)
            self.sandbox.start()
        return self.sandbox

    def _own_image(self, files_layer: bool = False) -> TaskImage:
        """The task's image, built if needed (with `files_layer`: unbuilt if it is one)."""
        return ensure_image(self.task, self.settings.rewrite, use_prebuilt=self.settings.use_prebuilt,
                            files_layer=files_layer, cancel=self.cancel)

    def _own_spec(self) -> SandboxSpec:
        """The spec of a container of the task's built image: a files layer's fallback."""
        spec = sandbox_spec(self.task, self.settings, self._own_image(), None, None, self.labels)
        spec.shell = self.shell
        return spec

    def _factory(self, spec: SandboxSpec) -> SpecFactory:
        return SpecFactory(self.settings.kind, spec, self._own_spec if spec.files is not None else None)

    def prewarm(self) -> bool:
        """Start this episode's container in the pool ahead of `open` (podman only)."""
        if self.pool is None or self.host_kind or self.image is None:
            return False
        if self.image.files is not None and not self.serves_files:
            return False  # its image is built when the episode opens
        spec = sandbox_spec(self.task, self.settings, self.image, None, None, self.labels)
        spec.shell = self.shell
        return self.pool.prewarm(pool_key(spec), self._factory(spec))

    def fork(self) -> tuple[Episode, ForkRecord]:
        """A child episode of the same task in a fork of this one's sandbox (`Sandbox.fork`,
        through the pool that handed it out): its files, working directory and shell state as
        they are now, isolated from this one. The child is the caller's to close; its verifier
        runs in its own copy. SandboxError when the fork fails (nothing of it is left)."""
        assert self.sandbox is not None, "fork() needs an open episode"
        pooled = self.pool is not None and not self.host_kind
        forked = self.pool.fork(self.sandbox) if pooled else self.sandbox.fork()
        child = Episode(self.task, self.settings, image=self.image, pool=self.pool if pooled else None,
                        name=self.name, labels=self.labels, cancel=self.cancel, shell=self.shell)
        child.sandbox, child.workdir = forked.sandbox, forked.record.workdir or self.workdir
        return child, forked.record

    @property
    def sandbox_id(self) -> str | None:
        """The container id (podman) or None: recorded so an episode names where it ran."""
        return getattr(self.sandbox, "container_id", None)

    @property
    def sandbox_mode(self) -> str:
        """podman: "overlay" (a fresh overlay of a shared container of the task's image),
        "overlay+files" (of one of its base image, its files written in: `tasks.files_layer`)
        or "container" (a fresh container); a host kind's name otherwise."""
        return getattr(self.sandbox, "mode", self.settings.kind)

    def verify(self, out_dir: Path | None, timeout: float) -> VerifierOutcome:
        """Copy tests/ in now (never before), run test.sh, read the reward. A sandbox that
        fails meanwhile comes back as `VerifierKind.INFRA`, never as a reward."""
        assert self.sandbox is not None
        run = run_host_verifier if self.host_kind else run_verifier
        try:
            return run(self.sandbox, self.task, self.workdir, out_dir, timeout)
        except SandboxError as e:
            return VerifierOutcome(None, VerifierKind.INFRA, f"the verifier could not run: {e}")

    def close(self) -> None:
        try:
            if self.sandbox is not None:
                if self.pool is not None and not self.host_kind:
                    self.pool.release(self.sandbox)
                else:
                    try:
                        self.sandbox.close()
                    except Exception:
                        pass
                    if self.on_sandbox:
                        self.on_sandbox(None)
        finally:
            self.sandbox = None
            if self.host is not None:
                self.host.close()
                self.host = None

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def episode_name(label: str) -> str:
    """A container name for one episode: readable, unique, within podman's limits."""
    return f"tmax-{label}".replace("__", "-").replace(":", "-").lower()[:60] + "-" + uuid.uuid4().hex[:6]


@dataclass
class PreparedTasks:
    """Tasks whose environment resolved, and the dropped ones with the reason."""

    images: dict[str, TaskImage | None]  # task dir -> image (None on host kinds)
    dropped: dict[str, str]  # task dir -> why it cannot run

    @property
    def runnable(self) -> list[str]:
        return list(self.images)


def prepare_environments(task_dirs: list[str], settings: EnvSettings,
                         progress: Callable[[int, int, str, str | None], None] | None = None,
                         workers: int = 4) -> PreparedTasks:
    """Resolve every task's environment before a run: build (or find in the content-hash
    cache) each image, `workers` at a time, or check each task runs on the host kind. A
    task that does not load or whose environment fails is dropped with its reason;
    nothing raises. `progress(done, total, task_dir, error)` is called after each task."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def one(d: str) -> tuple[TaskImage | None, str | None]:
        try:
            return resolve_environment(Task.load(d), settings), None
        except ENVIRONMENT_ERRORS as e:
            return None, str(e)
        except Exception as e:  # a task that does not load: a data problem
            return None, f"{type(e).__name__}: {e}"

    results: dict[str, tuple[TaskImage | None, str | None]] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tmax-env") as ex:
        futures = {ex.submit(one, d): d for d in task_dirs}
        for i, fut in enumerate(as_completed(futures)):
            d = futures[fut]
            results[d] = fut.result()
            if progress:
                progress(i + 1, len(task_dirs), d, results[d][1])
    images = {d: results[d][0] for d in task_dirs if results[d][1] is None}
    dropped = {d: results[d][1] for d in task_dirs if results[d][1] is not None}
    return PreparedTasks(images, dropped)  # type: ignore[arg-type]
