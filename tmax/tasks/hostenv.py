"""Tasks on the host sandboxes (`bwrap`, `local`) instead of a podman image.

The host stands in for the tmax base image, so a task can run there only when its
Dockerfile adds nothing but files and settings to that image: `FROM` the base image,
`WORKDIR`, `COPY` / `ADD` of files from the build context, and `ENV`. Anything else
(`RUN`, another base image, a multi-stage build) needs podman; `check_dockerfile`
names the first line that does, and the trial ends as an infrastructure error.

A runnable task gets a fresh host workspace per trial. The final WORKDIR is mapped onto
it: the COPY sources land where the Dockerfile puts them, relative to that WORKDIR. The
bwrap jail shows the workspace at the WORKDIR path itself (e.g. /app); `local` cannot
remap paths, so there the agent works in the workspace's host path.
"""

from __future__ import annotations

import glob
import json
import posixpath
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tmax.sandbox import sandbox_class
from tmax.sandbox.base import HOST_KINDS, SandboxSpec
from tmax.sandbox.base_image import DEFAULT_BASE_TAG, PYTHON_BASE_TAG
from tmax.tasks.dockerfile import instructions
from tmax.tasks.task_format import Task

# The host has python3, so it also stands in for the base of generated tasks.
HOST_BASE_IMAGES = (DEFAULT_BASE_TAG, PYTHON_BASE_TAG)
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


class HostEnvError(RuntimeError):
    """The task cannot run on a host sandbox: an infrastructure error, never the agent's."""


@dataclass
class Copy:
    sources: list[str]  # relative to the build context, may hold wildcards
    dest: str  # absolute image path
    dest_is_dir: bool  # `dst/` or several sources: sources go inside it
    line: int
    text: str


@dataclass
class HostPlan:
    workdir: str  # the final WORKDIR (absolute image path)
    copies: list[Copy] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def _args(rest: str) -> list[str]:
    """COPY/ADD arguments in exec (JSON) or shell form."""
    if rest.startswith("["):
        try:
            data = json.loads(rest)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list) and all(isinstance(x, str) for x in data):
            return data
    return shlex.split(rest)


def _env_pairs(rest: str) -> dict[str, str]:
    parts = shlex.split(rest)
    if parts and "=" not in parts[0]:  # legacy `ENV KEY value with spaces`
        return {parts[0]: " ".join(parts[1:])}
    out = {}
    for p in parts:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise ValueError(f"{p!r} is not KEY=VALUE")
        out[k] = v
    return out


def check_dockerfile(task: Task) -> HostPlan:
    """What the Dockerfile does to the base image, or HostEnvError naming the line that
    makes the task need podman."""
    rel = task.dockerfile.relative_to(task.path)
    text = task.dockerfile.read_text(encoding="utf-8", errors="replace")
    rule = (f"bwrap/local run a task only when its Dockerfile is FROM {' or '.join(HOST_BASE_IMAGES)} plus WORKDIR, "
            "COPY/ADD of local files and ENV; run it with -e podman")

    def fail(n: int, line: str, why: str) -> HostEnvError:
        return HostEnvError(f"{task.name} needs podman: {rel} line {n}: `{line[:200]}`: {why} ({rule})")

    workdir, seen_from = "/", False
    copies: list[Copy] = []
    env: dict[str, str] = {}
    for ins in instructions(text):
        n, line, op, rest = ins.line, " ".join(ins.text.split()), ins.op, ins.value
        if op == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            if seen_from:
                raise fail(n, line, "a multi-stage build")
            if not words or words[0] not in HOST_BASE_IMAGES:
                raise fail(n, line, "the host can only stand in for the tmax base image")
            seen_from = True
            continue
        if not seen_from:
            raise fail(n, line, "an instruction before FROM")
        if "$" in rest and op in ("WORKDIR", "COPY", "ADD"):
            raise fail(n, line, "variable substitution is not supported on the host")
        if op == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, rest))
        elif op in ("COPY", "ADD"):
            try:
                args = _args(rest)
            except ValueError as e:
                raise fail(n, line, f"cannot parse it ({e})") from None
            flags = [a for a in args if a.startswith("--")]
            args = [a for a in args if not a.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                raise fail(n, line, "a copy from another image or stage")
            if len(args) < 2:
                raise fail(n, line, "needs a source and a destination")
            *srcs, dest = args
            for s in srcs:
                if "://" in s or s.startswith("git@"):
                    raise fail(n, line, "a remote source")
                if op == "ADD" and s.lower().endswith(_ARCHIVES):
                    raise fail(n, line, "ADD unpacks archives, which the host setup does not do")
            absolute = posixpath.normpath(posixpath.join(workdir, dest))
            copies.append(Copy(srcs, absolute, dest.endswith("/") or dest in (".", "./") or len(srcs) > 1
                               or any(glob.has_magic(s) for s in srcs), n, line))
        elif op == "ENV":
            try:
                env.update(_env_pairs(rest))
            except ValueError as e:
                raise fail(n, line, f"cannot parse it ({e})") from None
        else:
            raise fail(n, line, f"{op} changes the image beyond files and settings")
    if not seen_from:
        raise HostEnvError(f"{task.name}: {rel} has no FROM line")
    if workdir == "/":
        raise HostEnvError(f"{task.name} needs podman: {rel} sets no WORKDIR; the host sandboxes map the "
                           "WORKDIR onto a fresh workspace, and / cannot be one")
    for c in copies:
        if c.dest != workdir and not c.dest.startswith(workdir.rstrip("/") + "/"):
            raise fail(c.line, c.text, f"the destination {c.dest} is outside the WORKDIR {workdir}, "
                                       "the only place the host workspace provides")
    return HostPlan(workdir, copies, env)


def _sources(context: Path, pattern: str, c: Copy, task: Task) -> list[Path]:
    root = context.resolve()
    hits = sorted(glob.glob(str(context / pattern.lstrip("/")))) if glob.has_magic(pattern) \
        else [str(context / pattern.lstrip("/"))]
    out = []
    for h in hits:
        p = Path(h)
        if not p.exists():
            continue
        if p.resolve() != root and root not in p.resolve().parents:
            raise HostEnvError(f"{task.name}: Dockerfile line {c.line}: `{c.text}`: {pattern} is outside the "
                               "build context")
        out.append(p)
    if not out:
        raise HostEnvError(f"{task.name}: Dockerfile line {c.line}: `{c.text}`: no file matches {pattern} "
                           f"in {context}")
    return out


def populate(task: Task, plan: HostPlan, workspace: Path) -> None:
    """Do the Dockerfile's copies into `workspace` (which stands for plan.workdir)."""
    context = task.environment_dir
    for c in plan.copies:
        rel = posixpath.relpath(c.dest, plan.workdir)
        target = workspace if rel == "." else workspace / rel
        for src in (s for pattern in c.sources for s in _sources(context, pattern, c, task)):
            if src.is_dir():  # like Docker: the directory's contents, not the directory
                shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
                continue
            dst = target / src.name if c.dest_is_dir or target.is_dir() else target
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


@dataclass
class HostEnv:
    """One trial's host environment: its workspace and the sandbox spec that uses it."""

    kind: str
    plan: HostPlan
    root: Path  # a private temp dir holding the workspace; removed by close()
    workspace: Path

    @property
    def workdir(self) -> str:
        """Where the agent starts and the verifier runs, as the sandbox sees it: where a sandbox
        that binds the workspace in puts it (`SandboxCapabilities.workspace_target`), else the
        workspace's host path."""
        return self.plan.workdir if self._targeted else str(self.workspace)

    @property
    def _targeted(self) -> bool:
        return sandbox_class(self.kind).capabilities.workspace_target

    def spec(self, network: bool, name: str | None = None, labels: dict[str, str] | None = None) -> SandboxSpec:
        target = self.plan.workdir if self._targeted else None
        return SandboxSpec(workdir=self.workdir, workspace=self.workspace, workspace_target=target,
                           network=network, env=dict(self.plan.env), name=name, labels=dict(labels or {}))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def prepare(task: Task, kind: str) -> HostEnv:
    """Check the task and build a fresh workspace for one trial (HostEnvError if the task
    needs podman)."""
    if kind not in HOST_KINDS:
        raise ValueError(f"{kind!r} is not a host sandbox kind ({', '.join(HOST_KINDS)})")
    plan = check_dockerfile(task)
    root = Path(tempfile.mkdtemp(prefix=f"tmax-hostenv-{task.name[:40]}-"))
    env = HostEnv(kind, plan, root, root / "workspace")
    try:
        env.workspace.mkdir()
        populate(task, plan, env.workspace)
    except BaseException:
        env.close()
        raise
    return env
