"""Task environment images, built with podman and cached by content.

The tag is `localhost/tmax-task/<task>:<hash>`, where the hash covers `environment/`,
the offline rewrite that applies to it and the base images' ids, so editing a task,
the image map, a patch or rebuilding the base gives a new image, and nothing else does.
Build logs stay in `<cache>/build-logs/`. A prebuilt `docker_image` is used when it is
present or can be pulled; offline that fails in well under a second and we build.

Where episodes are overlays of shared containers, a task that is its base image plus files
(`tasks.files_layer`) is not built at all: `ensure_image(files_layer=True)` hands back its
files and base image (`TaskImage.files`), identified by the same tag a build would give it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from tmax.sandbox import podman_service
from tmax.sandbox.base import LABEL_KEY, LABEL_VALUE, FilesLayer
from tmax.sandbox.base_image import DEFAULT_BASE_TAG
from tmax.common.files import cache_dir
from tmax.common.proctree import end_process_tree
from tmax.common.waiting import wait_until
from tmax.tasks.files_layer import LayerPlan, task_layer
from tmax.tasks.task_format import Task, tree_hash
from tmax.tasks.offline import RewriteConfig, RewrittenDockerfile, copy_patched, rewrite_dockerfile

TAG_REPO = "localhost/tmax-task"
BASE_TAG = DEFAULT_BASE_TAG


# What a failed build's log says about whose fault it is. A mirror or registry that does not
# answer is transient (the build is retried); podman's own storage or runtime failing is the
# machine's; anything else is a step of the Dockerfile failing: the task's fault.
_TRANSIENT = re.compile(
    r"Temporary failure (resolving|in name resolution)|Could not resolve|Failed to fetch|Connection (timed out|refused|"
    r"reset)|Network is unreachable|TLS handshake timeout|i/o timeout|Hash Sum mismatch|Read timed out|"
    r"Max retries exceeded with url|\b(502|503|504) (Bad Gateway|Service Unavailable|Gateway Time-?out)|"
    r"429 Too Many Requests|unexpected EOF|toomanyrequests", re.IGNORECASE)
_INFRA = re.compile(
    r"no space left on device|cannot connect to Podman|database is locked|creating overlay mount|setting up storage|"
    r"OCI runtime (error|create failed)|cannot set up namespace|insufficient UIDs", re.IGNORECASE)
BUILD_KINDS = ("task", "transient", "infra")
BUILD_ATTEMPTS = 3  # a transient failure is retried this many times in all


class ImageBuildError(RuntimeError):
    """The task's image could not be built, with a log and whose fault it is (`kind`):
    "task" (a step of its Dockerfile failed), "transient" (a mirror or registry did not
    answer, after the retries) or "infra" (podman, the machine, a missing base image, a
    timeout). Bench and learn treat every kind as an infrastructure error; `tmax data
    validate` rejects a task only for its own."""

    def __init__(self, message: str, log_path: Path | None = None, kind: str = "infra"):
        self.log_path = log_path
        self.kind = kind
        super().__init__(message + (f" (build log: {log_path})" if log_path else ""))


def classify_build_log(text: str) -> str:
    """task | transient | infra, from the tail of a failed build's log."""
    tail = text[-20000:]
    if _INFRA.search(tail):
        return "infra"
    if _TRANSIENT.search(tail):
        return "transient"
    return "task"


@dataclass
class TaskImage:
    tag: str  # with `files`, the tag a build would give it: the environment's identity
    workdir: str  # the image's final WORKDIR: agent start dir and verifier cwd
    built: bool  # False when it came from the cache or a prebuilt image, or was not built
    log_path: Path | None = None
    build_s: float = 0.0
    # A task that is its base image plus files, not built: the files, written into each
    # overlay episode of a container of the base image (its id: `base_id`).
    files: FilesLayer | None = None
    base_id: str | None = None

    @property
    def run_image(self) -> str:
        """The image its containers run: the base image for a files layer."""
        return self.base_id if self.files is not None and self.base_id else self.tag


def _image_attrs(tag: str) -> dict | None:
    """podman's record of the image `tag` (podman-py, `sandbox.podman_service`); None when it
    is not here."""
    from podman.errors import APIError

    with podman_service.client() as client:
        try:
            return client.images.get(tag).attrs
        except APIError:
            return None


def image_id(tag: str) -> str | None:
    attrs = _image_attrs(tag)
    return attrs["Id"] if attrs else None


def image_workdir(tag: str) -> str:
    return present_workdir(tag) or "/"


def present_workdir(tag: str) -> str | None:
    """The image's WORKDIR ("/" when unset), or None when the image is not here: whether it
    exists and where it starts in one `podman image inspect`."""
    attrs = _image_attrs(tag)
    return None if attrs is None else (attrs.get("Config") or {}).get("WorkingDir") or "/"


_pull_failed: set[str] = set()
_pull_lock = threading.Lock()


def try_pull(image: str, timeout: float = 60) -> str | None:
    """A prebuilt image's WORKDIR if it is here or pullable, else None; failures are
    remembered per process."""
    workdir = present_workdir(image)
    if workdir is not None:
        return workdir
    with _pull_lock:
        if image in _pull_failed:
            return None
    from podman.errors import APIError

    try:
        with podman_service.client(timeout=timeout) as client:
            client.images.pull(image)
    except (APIError, OSError):  # not found, refused, or no answer within `timeout` (requests' errors are OSErrors)
        pass
    # The pull's answer is a stream: a failed pull (an unknown registry offline) can come back
    # without raising, so only the image being here counts.
    workdir = present_workdir(image)
    if workdir is None:
        with _pull_lock:
            _pull_failed.add(image)
    return workdir


def image_tag(task: Task, cfg: RewriteConfig) -> tuple[str, RewrittenDockerfile, dict[str, str | None]]:
    """(tag, rewritten Dockerfile, each base image's id or None when it is not here) for a
    task under a rewrite config."""
    rewritten = rewrite_dockerfile(_patched_dockerfile(task, cfg), cfg)
    ids = {base: image_id(base) for base in dict.fromkeys(rewritten.base_images)}
    named = [ids[b] or f"missing:{b}" for b in rewritten.base_images]
    extra = cfg.fingerprint(task.name) + json.dumps(named).encode()
    digest = tree_hash(task.environment_dir, extra + rewritten.text.encode())[:16]
    return f"{TAG_REPO}/{task.name.lower()}:{digest}", rewritten, ids


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
                 files_layer: bool = False, build_timeout: float | None = None,
                 progress: Callable[[str], None] | None = None, cancel: threading.Event | None = None) -> TaskImage:
    """The task's image, from cache, a pullable prebuilt `docker_image`, or a fresh build;
    with `files_layer` (for overlay episodes only), a task that is its base image plus
    files comes back as those, unbuilt (`TaskImage.files`)."""
    prebuilt = task.config.environment.docker_image
    if use_prebuilt and prebuilt and not force and (workdir := try_pull(prebuilt)) is not None:
        return TaskImage(prebuilt, workdir, built=False)

    tag, rewritten, ids = image_tag(task, cfg)
    missing = [b for b, i in ids.items() if i is None]
    if files_layer and not force and not missing:
        plan = task_layer(task, _patched_dockerfile(task, cfg), cfg)
        if isinstance(plan, LayerPlan):
            return _layer_image(tag, plan, ids[plan.base])
    logs = cache_dir() / "build-logs"
    log_path = logs / f"{task.name}-{tag.rsplit(':', 1)[1]}.log"
    with _tag_lock(tag), _FileLock(cache_dir() / "locks" / (hashlib.sha1(tag.encode()).hexdigest() + ".lock")):
        workdir = None if force else present_workdir(tag)
        if workdir is not None:
            record_use(tag)
            return TaskImage(tag, workdir, built=False, log_path=log_path if log_path.exists() else None)
        for base in missing:
            if image_id(base) is None:  # still missing now that we hold the lock
                # The tmax base missing is the machine's problem; another image that cannot be
                # had is the Dockerfile's choice (it must be mapped or changed).
                if base == BASE_TAG:
                    raise ImageBuildError(f"{task.name}: base image {base} is not available (build it with "
                                          "`tmax sandbox build-base`)")
                raise ImageBuildError(f"{task.name}: base image {base} is not available (no registry is reachable: "
                                      "map it with --image-map FROM=TO)", kind="task")
        timeout = build_timeout or task.config.environment.build_timeout_sec
        t0 = time.monotonic()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        for attempt in Retrying(retry=retry_if_exception(_is_transient), stop=stop_after_attempt(BUILD_ATTEMPTS),
                                wait=wait_exponential(multiplier=2, max=30), reraise=True):
            with attempt:
                _build(task, cfg, tag, rewritten, log_path, timeout, progress, cancel)
        record_use(tag)
        return TaskImage(tag, image_workdir(tag), built=True, log_path=log_path, build_s=time.monotonic() - t0)


def _layer_image(tag: str, plan: LayerPlan, base_id: str | None) -> TaskImage:
    """The unbuilt environment of a files layer, on the base image of id `base_id`."""
    assert base_id is not None  # the caller checked that every base image is here
    workdir = plan.workdir or image_workdir(base_id)
    return TaskImage(tag, workdir, built=False, files=FilesLayer(plan.steps, workdir), base_id=base_id)


def _is_transient(e: BaseException) -> bool:
    return isinstance(e, ImageBuildError) and e.kind == "transient"


def _build(task: Task, cfg: RewriteConfig, tag: str, rewritten: RewrittenDockerfile, log_path: Path, timeout: float,
           progress: Callable[[str], None] | None, cancel: threading.Event | None) -> None:
    """One `podman build`, its output appended to the log; ImageBuildError with its kind."""
    with tempfile.TemporaryDirectory(prefix=f"tmax-build-{task.name}-") as tmp:
        ctx = Path(tmp) / "context"
        notes = copy_patched(task, "environment", ctx, cfg)
        dockerfile = Path(tmp) / "Dockerfile.tmax"
        dockerfile.write_text(rewritten.text)
        # No intermediate images: with `--layers` every step (and the labels) leaves an image
        # behind, about 3 per task, and every podman process (each container's cleanup among
        # them) reads the whole image store. One image per task, and a build costs less CPU.
        argv = ["podman", "--runtime", "runc", "build", "--layers=false", "-f", str(dockerfile), "-t", tag,
                "--label", f"{LABEL_KEY}={LABEL_VALUE}", "--label", f"{TASK_LABEL}={task.name}",
                "--ulimit", "nofile=1024:20000", "--ulimit", "nproc=4096:4096"]
        for k, v in scope_labels().items():
            argv += ["--label", f"{k}={v}"]
        if cfg.ca_bundle:
            argv += ["--volume", f"{cfg.ca_bundle}:{cfg.ca_mount[0][1]}:ro"]
        argv.append(str(ctx))
        start = log_path.stat().st_size
        with open(log_path, "a") as log:
            log.write(f"# task {task.name} -> {tag}\n")
            for n in rewritten.notes + notes:
                log.write(f"# {n}\n")
            log.write("# Dockerfile:\n" + "".join(f"#   {x}\n" for x in rewritten.text.splitlines()))
            log.write("$ " + " ".join(argv) + "\n")
            log.flush()
            rc = _run_logged(argv, log, timeout, progress, cancel)
    if rc == "timeout":
        raise ImageBuildError(f"{task.name}: image build exceeded build_timeout_sec={timeout:.0f}s", log_path)
    if rc == "cancelled":
        raise ImageBuildError(f"{task.name}: image build cancelled", log_path)
    if rc != 0:
        with open(log_path, errors="replace") as f:
            f.seek(start)
            kind = classify_build_log(f.read())
        what = {"task": "a step of its Dockerfile failed", "transient": "a mirror or registry did not answer",
                "infra": "podman or the machine failed"}[kind]
        raise ImageBuildError(f"{task.name}: image build failed (podman build exit {rc}; {what}): "
                              f"{_tail(log_path)}", log_path, kind)


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


# --- image hygiene: when each task image was last used, and pruning the least recent ---------

TASK_LABEL = "io.tmax.task"  # set on every image `ensure_image` builds
# Labels (KEY=VALUE,...) set on every task image this process builds and required of every
# image it prunes: one job's (or one user's) images, pruned apart from the others on a
# shared podman store.
SCOPE_ENV = "TMAX_IMAGE_LABELS"


def parse_labels(items) -> dict[str, str]:
    """KEY=VALUE items as a dict; ValueError names a malformed one."""
    out = {}
    for item in items:
        k, sep, v = item.strip().partition("=")
        if not sep or not k:
            raise ValueError(f"{item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def scope_labels() -> dict[str, str]:
    """The labels of $TMAX_IMAGE_LABELS (none when unset)."""
    raw = os.environ.get(SCOPE_ENV, "")
    try:
        return parse_labels(x for x in raw.split(",") if x.strip())
    except ValueError as e:
        raise ImageBuildError(f"{SCOPE_ENV}: {e}") from None


def _use_stamp(tag: str) -> Path:
    return cache_dir() / "image-use" / hashlib.sha1(tag.encode()).hexdigest()


def record_use(tag: str) -> None:
    """Note that a task image was used now (its last-use time orders `prune_images`)."""
    stamp = _use_stamp(tag)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(tag + "\n")  # rewriting updates the mtime


@dataclass
class ImageUse:
    id: str
    names: list[str]
    size: int  # bytes; layers shared with other images are counted in each
    last_used: float  # epoch seconds: the latest use stamp of its names, else its creation


def task_images(labels: dict[str, str] | None = None) -> list[ImageUse]:
    """The task images tmax built (labelled by `ensure_image`; never the base image or a
    pulled one), least recently used first; $TMAX_IMAGE_LABELS and `labels` narrow them."""
    from podman.errors import APIError

    try:
        with podman_service.client() as client:
            listed = [i.attrs for i in client.images.list(filters={"label": f"{LABEL_KEY}={LABEL_VALUE}"})]
    except APIError as e:
        raise ImageBuildError(f"listing podman's images failed: {e}") from e
    want = {LABEL_KEY: LABEL_VALUE, **scope_labels(), **(labels or {})}
    out = []
    for img in listed:
        names = img.get("Names") or []
        have = img.get("Labels") or {}
        # every label must match (podman ORs repeated label filters, so they are checked here)
        if TASK_LABEL not in have or not names or any(have.get(k) != v for k, v in want.items()):
            continue  # the base image, an unnamed build-cache layer, or not asked for
        stamps = [_use_stamp(n).stat().st_mtime for n in names if _use_stamp(n).is_file()]
        out.append(ImageUse(img["Id"], names, int(img.get("Size") or 0), max(stamps, default=float(img["Created"]))))
    return sorted(out, key=lambda i: i.last_used)


@dataclass
class PruneReport:
    removed: list[ImageUse]
    kept: list[ImageUse]
    errors: list[str]


def _remove_image(image: str) -> str | None:
    """Remove an image (not one a container uses); why not, when it was refused."""
    from podman.errors import APIError

    try:
        with podman_service.client() as client:
            client.images.remove(image)
    except APIError as e:
        return str(e)
    return None


def prune_images(keep_bytes: int, labels: dict[str, str] | None = None, dry_run: bool = False) -> PruneReport:
    """Remove tmax-built task images, least recently used first, until the rest take at
    most `keep_bytes`. An image a container still uses is left (and reported)."""
    images = task_images(labels)
    total = sum(i.size for i in images)
    rep = PruneReport([], [], [])
    for img in images:
        if total <= keep_bytes:
            rep.kept.append(img)
            continue
        why = None if dry_run else _remove_image(img.id)
        if why is not None:
            rep.errors.append(f"{img.names[0]}: {why[-300:]}")
            rep.kept.append(img)
            continue
        rep.removed.append(img)
        total -= img.size
    return rep
