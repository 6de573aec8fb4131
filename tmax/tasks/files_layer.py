"""Which task environments are a base image plus files, and which files (`sandbox.base.FilesLayer`).

A task whose Dockerfile is one stage of FROM (a plain image reference), WORKDIR and COPY
from the build context needs no image of its own where its episodes are overlays of a
shared container (`sandbox.overlay_pool`): a container of the base image serves it, the
COPY'd files written into each episode's fresh root (`sandbox.overlay_files.write_layer`),
as `podman build` lays them down: the same paths, contents, modes and file mtimes, owner
root, the directories a COPY or WORKDIR makes. The built image's environment is the base's
plus the CA variables of the offline rewrite, which every sandbox of a task sets anyway
(`RewriteConfig.ca_env`); its USER is the base's.

Whatever that equality is not sure for is built as before (`plan_layer` says why):
* any other instruction (RUN, ENV, USER, ADD, ARG, ...), a second FROM, FROM with flags or a
  variable; an offline base-image map whose setup runs commands or sets variables;
* COPY with flags (--chown, --chmod, --from, --link), globs, variables or a heredoc; several
  sources into a destination without a trailing "/";
* a source outside the build context or missing, or one holding a symlink, a special file
  or a file with other hard links;
* a relative WORKDIR or COPY destination before any absolute WORKDIR (it would depend on
  the base image's);
* a `.dockerignore` in the context, or patches (`tasks/data/patches.toml`) to its files;
* more than `MAX_LAYER_BYTES` of files: every episode writes its own copy, where the
  episodes of a built image share one.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
from dataclasses import dataclass
from pathlib import Path

from tmax.sandbox.base import LayerCopy, LayerDir
from tmax.tasks.dockerfile import Instruction, from_parts, instructions
from tmax.tasks.task_format import Task
from tmax.tasks.offline import RewriteConfig

_GLOB = set("*?[")
MAX_LAYER_BYTES = 32 << 20


@dataclass(frozen=True)
class LayerPlan:
    """A task environment that is its base image plus files."""

    base: str  # the base image, after the offline map
    steps: tuple[LayerCopy | LayerDir, ...]
    workdir: str | None  # the final WORKDIR; None: the base image's own


@dataclass(frozen=True)
class NotALayer:
    """Why the environment must be built."""

    reason: str


def task_layer(task: Task, dockerfile: str, cfg: RewriteConfig) -> LayerPlan | NotALayer:
    """`plan_layer` for a task whose Dockerfile (patched) reads `dockerfile`."""
    context = task.environment_dir
    if (context / ".dockerignore").exists():
        return NotALayer("a .dockerignore filters the build context")
    if any(p.file != "environment/Dockerfile" for p in cfg.patches_for(task.name, "environment/")):
        return NotALayer("files of the build context are patched")
    return plan_layer(dockerfile, context, cfg)


def plan_layer(text: str, context: Path, cfg: RewriteConfig) -> LayerPlan | NotALayer:
    """The files layer of a Dockerfile (`text`, build context `context`) under the offline
    map of `cfg`, or why it has none."""
    ins = instructions(text)
    if not ins or ins[0].op != "FROM":
        return NotALayer("the Dockerfile does not start with FROM")
    try:
        parts = from_parts(ins[0].value)
    except ValueError as e:
        return NotALayer(str(e))
    if parts.flags or "$" in parts.image:
        return NotALayer(f"FROM {ins[0].value}: flags or variables")
    rule = cfg.match(parts.image)
    setup = rule.setup if rule else None
    if setup is not None and (setup.run or setup.env):
        return NotALayer(f"the offline map of {parts.image} adds build steps")
    steps: list[LayerCopy | LayerDir] = []
    workdir = setup.workdir if setup is not None else None
    if workdir:
        steps.append(LayerDir(workdir))
    for i in ins[1:]:
        if i.op == "WORKDIR":
            workdir = _join(workdir, i.value)
            if workdir is None:
                return NotALayer(f"line {i.line}: WORKDIR {i.value} depends on the base image or a variable")
            steps.append(LayerDir(workdir))
        elif i.op == "COPY":
            step = _copy(i, context, workdir)
            if isinstance(step, NotALayer):
                return step
            steps.append(step)
        else:
            return NotALayer(f"line {i.line}: {i.op}")
    size = sum(_tree_bytes(Path(src)) for step in steps if isinstance(step, LayerCopy) for src in step.sources)
    if size > MAX_LAYER_BYTES:
        return NotALayer(f"{size} bytes of files: each episode would copy them, a built image's share them")
    return LayerPlan(rule.target if rule else parts.image, tuple(steps), workdir)


def _join(workdir: str | None, path: str) -> str | None:
    """`path` made absolute against `workdir` and normalised; None when it has a variable or
    is relative with no WORKDIR yet."""
    if "$" in path or not path or (not path.startswith("/") and workdir is None):
        return None
    joined = posixpath.normpath(posixpath.join(workdir or "/", path))
    return "/" + joined.lstrip("/")


def _copy(i: Instruction, context: Path, workdir: str | None) -> LayerCopy | NotALayer:
    """One COPY instruction as a step, or why it is not one."""
    words = _copy_words(i.value)
    if words is None or len(words) < 2:
        return NotALayer(f"line {i.line}: COPY {i.value}: not a plain list of paths")
    if any(w.startswith("--") or w.startswith("<<") for w in words):
        return NotALayer(f"line {i.line}: COPY with flags or a heredoc")
    *sources, dest = words
    if any("$" in w or "\\" in w or _GLOB & set(w) for w in words):
        return NotALayer(f"line {i.line}: COPY with globs, variables or escapes")
    into = dest.endswith("/") or len(sources) > 1
    if len(sources) > 1 and not dest.endswith("/"):
        return NotALayer(f"line {i.line}: several sources need a destination ending in /")
    target = _join(workdir, dest)
    if target is None:
        return NotALayer(f"line {i.line}: the COPY destination {dest} depends on the base image")
    paths = []
    for src in sources:
        path, why = _source(context, src)
        if why:
            return NotALayer(f"line {i.line}: COPY {src}: {why}")
        paths.append(str(path))
    return LayerCopy(tuple(paths), target, into)


def _copy_words(value: str) -> list[str] | None:
    """The words of a COPY: its JSON form or whitespace-separated."""
    if value.lstrip().startswith("["):
        try:
            words = json.loads(value)
        except ValueError:
            return None
        return words if isinstance(words, list) and all(isinstance(w, str) for w in words) else None
    return value.split()


def _source(context: Path, src: str) -> tuple[Path, str | None]:
    """A COPY source inside the build context (a leading / names the context's root), and
    what keeps it from being copied as it is, if anything."""
    rel = posixpath.normpath(src.lstrip("/") or ".")
    if rel == ".." or rel.startswith("../"):
        return context, "outside the build context"
    path = context / rel
    if not os.path.lexists(path):
        return path, "no such file in the build context"
    return path, _tree_problem(path)


def _tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in [path, *path.rglob("*")] if p.is_file())


def _tree_problem(path: Path) -> str | None:
    """A symlink, special file or hard-linked file under `path`, named; None when none."""
    for entry in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else [])]:
        st = entry.lstat()
        if stat.S_ISLNK(st.st_mode):
            return f"{entry} is a symlink"
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return f"{entry} is not a regular file or directory"
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return f"{entry} has other hard links"
    return None
