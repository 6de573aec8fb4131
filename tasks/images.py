"""Task environment images, built with podman and cached by content.

The tag is `localhost/tmax-task/<task>:<hash>`, where the hash covers `environment/`,
the offline rewrite that applies to it and the base images' ids, so editing a task,
the image map, a patch or rebuilding the base gives a new image, and nothing else does.
Build logs stay in `<cache>/build-logs/`. A prebuilt `docker_image` is used when it is
present or can be pulled; offline that fails in well under a second and we build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandbox.base import LABEL_KEY, LABEL_VALUE
from sandbox.proctree import end_process_tree
from sandbox.waiting import wait_until
from tasks.model import Task, tree_hash
from tasks.offline import RewriteConfig, RewrittenDockerfile, copy_patched, rewrite_dockerfile

TAG_REPO = "localhost/tmax-task"
BASE_TAG = "localhost/tmax-base:bookworm"


class ImageBuildError(RuntimeError):
    """The task's image could not be built: an infrastructure error, with a log."""

    def __init__(self, message: str, log_path: Path | None = None):
        self.log_path = log_path
        super().__init__(message + (f" (build log: {log_path})" if log_path else ""))


@dataclass
class TaskImage:
    tag: str
    workdir: str  # the image's final WORKDIR: agent start dir and verifier cwd
    built: bool  # False when it came from the cache or a prebuilt image
    log_path: Path | None = None
    build_s: float = 0.0


def cache_dir() -> Path:
    env = os.environ.get("TMAX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tmax"


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def image_exists(tag: str) -> bool:
    return _podman("image", "exists", tag).returncode == 0


def image_id(tag: str) -> str | None:
    r = _podman("image", "inspect", "--format", "{{.Id}}", tag)
    return r.stdout.strip() or None if r.returncode == 0 else None


def image_workdir(tag: str) -> str:
    r = _podman("image", "inspect", "--format", "{{.Config.WorkingDir}}", tag)
    return (r.stdout.strip() or "/") if r.returncode == 0 else "/"


_pull_failed: set[str] = set()
_pull_lock = threading.Lock()


def try_pull(image: str, timeout: float = 60) -> bool:
    """Use a prebuilt image if it is here or pullable; remember failures per process."""
    if image_exists(image):
        return True
    with _pull_lock:
        if image in _pull_failed:
            return False
    try:
        ok = _podman("pull", "--quiet", image, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    if not ok:
        with _pull_lock:
            _pull_failed.add(image)
    return ok


def image_tag(task: Task, cfg: RewriteConfig) -> tuple[str, RewrittenDockerfile]:
    """(tag, rewritten Dockerfile) for a task under a rewrite config."""
    rewritten = rewrite_dockerfile(_patched_dockerfile(task, cfg), cfg)
    ids = []
    for base in rewritten.base_images:
        ids.append(image_id(base) or f"missing:{base}")
    extra = cfg.fingerprint(task.name) + json.dumps(ids).encode() + rewritten.text.encode()
    digest = tree_hash(task.environment_dir, extra)[:16]
    return f"{TAG_REPO}/{task.name.lower()}:{digest}", rewritten


def _patched_dockerfile(task: Task, cfg: RewriteConfig) -> str:
    text = task.dockerfile.read_text(encoding="utf-8")
    for p in cfg.patches_for(task.name, "environment/Dockerfile"):
        if p.find in text:
            text = text.replace(p.find, p.replace)
    return text


class _FileLock:
    """Cross-process lock so two jobs never build the same tag at once."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd: int | None = None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        assert self.fd is not None
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _tag_lock(tag: str) -> threading.Lock:
    with _thread_locks_guard:
        return _thread_locks.setdefault(tag, threading.Lock())


def ensure_image(task: Task, cfg: RewriteConfig, *, use_prebuilt: bool = True, force: bool = False,
                 build_timeout: float | None = None, progress: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> TaskImage:
    """The task's image, from cache, a pullable prebuilt `docker_image`, or a fresh build."""
    prebuilt = task.config.environment.docker_image
    if use_prebuilt and prebuilt and not force and try_pull(prebuilt):
        return TaskImage(prebuilt, image_workdir(prebuilt), built=False)

    tag, rewritten = image_tag(task, cfg)
    logs = cache_dir() / "build-logs"
    log_path = logs / f"{task.name}-{tag.rsplit(':', 1)[1]}.log"
    with _tag_lock(tag), _FileLock(cache_dir() / "locks" / (hashlib.sha1(tag.encode()).hexdigest() + ".lock")):
        if not force and image_exists(tag):
            return TaskImage(tag, image_workdir(tag), built=False, log_path=log_path if log_path.exists() else None)
        for base in rewritten.base_images:
            if not image_exists(base):
                hint = " (build it with `tmax sandbox build-base`)" if base == BASE_TAG else \
                    " (no registry is reachable: map it with --image-map FROM=TO)"
                raise ImageBuildError(f"{task.name}: base image {base} is not available{hint}")
        timeout = build_timeout or task.config.environment.build_timeout_sec
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"tmax-build-{task.name}-") as tmp:
            ctx = Path(tmp) / "context"
            notes = copy_patched(task, "environment", ctx, cfg)
            dockerfile = Path(tmp) / "Dockerfile.tmax"
            dockerfile.write_text(rewritten.text)
            argv = ["podman", "--runtime", "runc", "build", "--layers", "-f", str(dockerfile), "-t", tag,
                    "--label", f"{LABEL_KEY}={LABEL_VALUE}", "--label", f"io.tmax.task={task.name}",
                    "--ulimit", "nofile=1024:20000", "--ulimit", "nproc=4096:4096"]
            if cfg.ca_bundle:
                argv += ["--volume", f"{cfg.ca_bundle}:{cfg.ca_mount[0][1]}:ro"]
            argv.append(str(ctx))
            logs.mkdir(parents=True, exist_ok=True)
            with open(log_path, "w") as log:
                log.write(f"# task {task.name} -> {tag}\n")
                for n in rewritten.notes + notes:
                    log.write(f"# {n}\n")
                log.write("# Dockerfile:\n" + "".join(f"#   {x}\n" for x in rewritten.text.splitlines()))
                log.write("$ " + " ".join(argv) + "\n")
                log.flush()
                rc = _run_logged(argv, log, timeout, progress, cancel)
        elapsed = time.monotonic() - t0
        if rc == "timeout":
            raise ImageBuildError(f"{task.name}: image build exceeded build_timeout_sec={timeout:.0f}s", log_path)
        if rc == "cancelled":
            raise ImageBuildError(f"{task.name}: image build cancelled", log_path)
        if rc != 0:
            raise ImageBuildError(f"{task.name}: image build failed (podman build exit {rc}): "
                                  f"{_tail(log_path)}", log_path)
        return TaskImage(tag, image_workdir(tag), built=True, log_path=log_path, build_s=elapsed)


def _run_logged(argv: list[str], log, timeout: float, progress, cancel) -> int | str:
    """The build's exit status, or why it was stopped ("timeout", "cancelled")."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def ended() -> tuple[int] | None:  # a tuple: exit status 0 is an answer too
        try:
            return (proc.wait(timeout=1.0),)
        except subprocess.TimeoutExpired:
            pass
        if cancel is not None and cancel.is_set():
            raise _Cancelled()
        if progress:
            progress("building")
        return None

    try:
        done = wait_until(ended, timeout, 0)
        reason = "timeout"
    except _Cancelled:
        done, reason = None, "cancelled"
    if done:
        return done[0]
    end_process_tree(proc.pid, grace_s=10)
    proc.wait()
    log.write(f"\n# tmax: build {reason}\n")
    return reason


class _Cancelled(Exception):
    """The build was cancelled while it was awaited."""


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-800:]
