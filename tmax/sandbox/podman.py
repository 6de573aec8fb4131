"""A podman container, driven through podman-py against the REST service.

The container runs `sleep infinity`; the agent's persistent shell is `podman exec -it CID
bash` on a pty, and harness work goes through `exec_run`. With `SandboxSpec.user` set, the
shell and every exec not told otherwise run as that user (`--user`; podman sets HOME from
its passwd entry), while the container itself keeps the image's USER. Network is off
unless asked, cpu / memory / pids / file size are limited (docs/DESIGN.md, "Limits"), an
init (catatonit) reaps orphans so a fork bomb's leftovers give their pids back, and every
container carries the tmax label so `tmax sandbox clean` finds leftovers of crashed runs.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import logging
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from tmax.sandbox import podman_service
from tmax.sandbox.base import (
    IMAGE_USER, AgentUserError, LABEL_KEY, LABEL_VALUE, NAME_PREFIX, CommandResult, SandboxCapabilities, SandboxError,
    SandboxSpec,
)
from tmax.sandbox.hostexec import MAX_EXEC_CHARS
from tmax.sandbox.base_image import DEFAULT_BASE_TAG
from tmax.sandbox.shell import BASH_ARGV, PersistentShell
from tmax.sandbox.shell_sandbox import ShellSandbox
from tmax.common.waiting import wait_until

log = logging.getLogger(__name__)

# This machine's hard RLIMIT_NOFILE is 20000 and the runtime may not exceed it.
DEFAULT_ULIMITS = {"nofile": (1024, 20000), "nproc": (4096, 4096)}
# containers-common's default seccomp profile (what podman applies when told nothing).
DEFAULT_SECCOMP_PROFILE = Path("/usr/share/containers/seccomp.json")
X32_SYSCALL_BIT = 0x40000000
CGROUP_PARENT_ENV = "TMAX_PODMAN_CGROUP_PARENT"
_seccomp_lock = threading.Lock()


def kernel_runs_x32() -> bool:
    """Whether this kernel takes x32-ABI syscalls (`getpid` through the x32 bit). Most
    distribution kernels are built without them or turn them off, and then no process can
    make one: a seccomp filter need not cover that ABI."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(X32_SYSCALL_BIT | 39)) >= 0


def _containers_confs() -> list[Path]:
    """podman's containers.conf files, in the order it reads them (`man containers.conf`)."""
    if os.environ.get("CONTAINERS_CONF"):
        return [Path(os.environ["CONTAINERS_CONF"])]
    user = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "containers"
    return [Path("/usr/share/containers/containers.conf"), Path("/etc/containers/containers.conf"),
            *sorted(Path("/etc/containers/containers.conf.d").glob("*.conf")), user / "containers.conf",
            *sorted((user / "containers.conf.d").glob("*.conf"))]


def _profile_configured() -> bool:
    """Whether a containers.conf names its own seccomp profile (podman then applies that one)."""
    import tomllib

    for conf in _containers_confs():
        try:
            if tomllib.loads(conf.read_text()).get("containers", {}).get("seccomp_profile"):
                return True
        except (OSError, ValueError):
            continue
    return False


@functools.cache
def _seccomp_profile_text(default: Path) -> str | None:
    if platform.machine() != "x86_64" or kernel_runs_x32() or _profile_configured():
        return None
    try:
        profile = json.loads(default.read_text())
    except (OSError, ValueError):
        return None
    for entry in profile.get("archMap") or []:
        if entry.get("architecture") == "SCMP_ARCH_X86_64":
            entry["subArchitectures"] = [a for a in entry.get("subArchitectures") or [] if a != "SCMP_ARCH_X32"]
    return json.dumps(profile, sort_keys=True)


_seccomp_dir: list[str] = []  # this process's private directory for the profile file


def seccomp_profile(default: Path = DEFAULT_SECCOMP_PROFILE) -> str | None:
    """The path of podman's default seccomp profile less the x32 ABI on a kernel that cannot
    run it (None: what podman applies itself, its default or the profile a containers.conf
    names). The same rules for every ABI a process here
    can use, 32-bit x86 included; runc compiles the profile for each architecture it lists at
    every container start and exec, and libseccomp was 14 % of a container life's CPU
    (`benchmarks/podman_episode_profile.py` compares the two). The file lives in a directory
    only this process writes (a shared temp path could be planted with a laxer profile)."""
    text = _seccomp_profile_text(default)
    if text is None:
        return None
    with _seccomp_lock:
        if not _seccomp_dir or not os.path.isdir(_seccomp_dir[0]):
            _seccomp_dir[:] = [tempfile.mkdtemp(prefix=NAME_PREFIX + "seccomp-")]
            atexit.register(shutil.rmtree, _seccomp_dir[0], True)
        path = Path(_seccomp_dir[0]) / "profile.json"
        if not path.is_file():
            path.write_text(text)
    return str(path)


def _decode(b: bytes | None) -> str:
    return (b or b"")[-MAX_EXEC_CHARS:].decode("utf-8", errors="replace")


class PodmanSandbox(ShellSandbox):
    kind = "podman"
    mode = "container"  # a container of its own (`sandbox.overlay`: an overlay of a shared one)
    capabilities = SandboxCapabilities(snapshot="container", limits=True, network=True, own_root=True)

    @classmethod
    def prestart(cls) -> None:
        podman_service.prestart()  # the REST service takes most of a second on a busy machine

    def __init__(self, spec: SandboxSpec | None = None, runtime: str = podman_service.DEFAULT_RUNTIME,
                 ulimits: dict[str, tuple[int, int]] | None = None):
        self.spec = spec or SandboxSpec()
        self.runtime = runtime
        self.ulimits = dict(DEFAULT_ULIMITS if ulimits is None else ulimits)
        if self.spec.storage_mb:
            size = int(self.spec.storage_mb) * 1024 * 1024
            self.ulimits.setdefault("fsize", (size, size))  # bytes
        self.image = self.spec.image or DEFAULT_BASE_TAG
        self.name = self.spec.name or f"{NAME_PREFIX}{secrets.token_hex(6)}"
        self.client = None
        self.container = None
        self.shell: PersistentShell | None = None
        self.workdir: str | None = None
        self._closed = False
        # `close` may come from another thread while `start` creates the container (a job's
        # Ctrl-C): it waits for the container to exist, then removes it; `start` then stops.
        self._life = threading.RLock()

    @property
    def container_id(self) -> str | None:
        return self.container.id if self.container is not None else None

    # -- lifecycle --------------------------------------------------------------------

    def create_kwargs(self) -> dict:
        s = self.spec
        kw: dict = {
            "name": self.name,
            # The owner PID lets `tmax sandbox clean` spare containers of live runs.
            "labels": {LABEL_KEY: LABEL_VALUE, "io.tmax.pid": str(os.getpid()), **s.labels},
            "detach": True,
            "network_mode": "bridge" if s.network else "none",
            "ulimits": [{"Name": k, "Soft": soft, "Hard": hard} for k, (soft, hard) in self.ulimits.items()],
            "environment": dict(s.env),
            "stop_signal": 9,  # an int: podman 4.3 rejects signal names here
            # PID 1 reaps orphans: `sleep infinity` would keep every orphaned zombie, and each
            # holds one of the pids the limit allows, for the container's whole life.
            "init": True,
        }
        if os.environ.get(CGROUP_PARENT_ENV):
            # Every container (and its conmon) under one cgroup: their CPU measured or capped together.
            kw["cgroup_parent"] = os.environ[CGROUP_PARENT_ENV]
        remote = (podman_service.configured_url() or "unix://").split("://", 1)[0] != "unix"
        seccomp = None if remote else seccomp_profile()  # a path on this machine: local services only
        if seccomp:
            kw["seccomp_profile_path"] = seccomp
        if s.cpus:
            # nano_cpus is dropped on the way to podman 4.3; period/quota is honoured.
            kw["cpu_period"] = 100_000
            kw["cpu_quota"] = int(s.cpus * 100_000)
        if s.memory_mb:
            kw["mem_limit"] = f"{int(s.memory_mb)}m"
            kw["memswap_limit"] = f"{int(s.memory_mb)}m"  # no swap on top: the limit is the limit
        if s.pids_limit:
            kw["pids_limit"] = int(s.pids_limit)
        mounts = []
        if s.workspace is not None:
            ws = Path(s.workspace).resolve()
            if not ws.is_dir():
                raise SandboxError(f"podman sandbox: workspace {ws} is not a directory")
            mounts.append({"type": "bind", "source": str(ws), "target": s.workspace_target or str(ws),
                           "read_only": False})
        for host, target, ro in s.mounts:
            mounts.append({"type": "bind", "source": host, "target": target, "read_only": bool(ro)})
        if mounts:
            kw["mounts"] = mounts
        workdir = s.workdir or (s.workspace_target or (str(Path(s.workspace).resolve()) if s.workspace else None))
        if workdir:
            kw["working_dir"] = workdir
        return kw

    def main_command(self) -> list[str]:
        """What the container runs while it lives (the commands come through `exec`)."""
        return ["sleep", "infinity"]

    def start(self) -> None:
        with self._life:
            if self._closed:
                raise SandboxError("podman sandbox: closed before it started")
            self._start_container()
            container = self.container
        if not self.spec.shell:
            return
        # The CLI as a client of the service that made the container (the configured one or
        # this process's own): a local `podman exec` opens the container database and storage
        # itself, about 40 ms more CPU a shell (benchmarks/podman_episode_profile.py).
        argv = ["podman", "--url", podman_service.service_url(self.runtime)]
        # `podman exec` can hand the shell the CLI's own limits instead of the container's;
        # lowering a limit is always allowed, so apply the configured ones. The file size cap
        # is lowered hard as well (bash counts it in KiB), so the agent cannot raise it back.
        soft = "; ".join(
            f"ulimit -S -{flag} {self.ulimits[name][0]} 2>/dev/null"
            for name, flag in (("nofile", "n"), ("nproc", "u"))
            if name in self.ulimits
        )
        if "fsize" in self.ulimits:
            soft = "; ".join(filter(None, [soft, f"ulimit -f {self.ulimits['fsize'][1] // 1024} 2>/dev/null"]))
        inner = shlex.join(BASH_ARGV)
        argv += ["exec", "-it", *(["--user", self.spec.user] if self.spec.user else []), container.id,
                 "bash", "-c", f"{soft}; exec {inner}" if soft else f"exec {inner}"]
        self.shell = PersistentShell(argv, workdir=self.workdir, kill_inner=self._kill_inner,
                                     kill_foreground_inner=self._kill_foreground_inner)
        try:
            self.shell.start()
        except Exception as e:
            closed_meanwhile = self._closed
            self.close()
            if closed_meanwhile:  # its pty may be gone under it: any error means "closed"
                raise SandboxError("podman sandbox: closed while its shell was starting") from e
            if not isinstance(e, SandboxError):
                raise
            if self.spec.user:
                raise AgentUserError(f"podman sandbox: no shell as user {self.spec.user!r} in {self.workdir}"
                                     f" of {self.image}: {e}") from e
            raise

    def _kill_inner(self, pid: int) -> None:
        # The `podman exec` client dying does not end the bash it started: hang it up
        # (bash passes SIGHUP on to its jobs), then kill it.
        if self.container is not None:
            self.container.exec_run(["sh", "-c", f"kill -HUP {pid}; sleep 0.2; kill -KILL {pid}"], demux=True)

    def _kill_foreground_inner(self, pid: int) -> None:
        # The pty seen from the host belongs to the `podman exec` client; the command's
        # group is the foreground group (field 8 of /proc/PID/stat) of the shell's own pty.
        if self.container is not None:
            script = (f"g=$(cut -d' ' -f8 /proc/{pid}/stat); "
                      f"[ \"$g\" -gt 0 ] && [ \"$g\" != {pid} ] && kill -KILL -- -\"$g\"")
            self.container.exec_run(["bash", "-c", script], demux=True)

    def _start_container(self) -> None:
        from podman.errors import APIError, ImageNotFound

        self.client = podman_service.client(self.runtime)
        try:
            # No separate existence check (one round trip less): create refuses a missing image.
            self.container = self.client.containers.create(self.image, self.main_command(), **self.create_kwargs())
            self.container.start()
            self.container.reload()
        except (ImageNotFound, APIError) as e:
            self.close()
            if isinstance(e, ImageNotFound) or "image not known" in str(e):
                raise SandboxError(f"podman sandbox: image {self.image} not found (build the base image with "
                                   f"`tmax sandbox build-base`): {e}") from e
            raise SandboxError(f"podman sandbox: could not start a container from {self.image}: {e}") from e
        if self.container.status != "running":
            self.close()
            raise SandboxError(f"podman sandbox: container {self.name} is {self.container.status}, not running")
        self.workdir = self.container.attrs.get("Config", {}).get("WorkingDir") or "/"

    def close(self) -> None:
        with self._life:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_shell()
        if self.container is not None:
            ct = self.container
            try:
                ct.remove(force=True)  # kills it first (stop signal 9, no grace period)
            except Exception:
                pass  # already gone, or busy: checked below
            # A remove can lose a race with an exec session still winding down (Ctrl-C during
            # a command) or time out on a loaded machine: make sure the container is gone.
            def removed() -> bool:
                try:
                    if self.client is None or not self.client.containers.exists(ct.id):
                        return True
                except Exception:
                    pass  # a busy service: try again
                subprocess.run(["podman", "rm", "-f", "-t", "0", ct.id], capture_output=True, timeout=120)
                return False

            if not wait_until(removed, 3.0, 1.0):
                log.warning("podman sandbox: container %s is still there after removal; "
                            "`tmax sandbox clean` removes it", self.name)
            self.container = None
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None

    # -- commands ---------------------------------------------------------------------

    def exec(self, argv: list[str], timeout: float | None = None, workdir: str | None = None,
             env: dict[str, str] | None = None, user: str | None = None) -> CommandResult:
        """One-off process via the REST API, stdout and stderr separate, as `user` (None:
        the agent's user). A timeout is enforced inside with coreutils `timeout` (the API
        cannot cancel an exec)."""
        if self.container is None:
            raise SandboxError("sandbox is not started")
        from podman.errors import APIError

        cmd = list(argv)
        if timeout is not None:
            cmd = ["timeout", "-k", "5", f"{timeout:g}"] + cmd
        t0 = time.monotonic()
        result: dict = {}

        def work() -> None:
            # The exec call blocks for as long as the command runs, so it gets its own client
            # whose HTTP timeout outlasts the command (the sandbox's client keeps a short one
            # so a wedged service cannot hang container management forever).
            try:
                with podman_service.client(self.runtime, timeout=None if timeout is None else timeout + 60) as c:
                    ct = c.containers.get(self.container.id)
                    result["r"] = ct.exec_run(cmd, demux=True, workdir=workdir, environment=env,
                                             user=self.spec.user if user is None else user)
            except Exception as e:  # reported below, on the caller's thread
                result["e"] = e

        th = threading.Thread(target=work, daemon=True)
        th.start()
        th.join(None if timeout is None else timeout + 30)
        if th.is_alive():
            return CommandResult(output="", exit_code=124, timed_out=True, duration_s=time.monotonic() - t0,
                                 note="exec did not return after its timeout")
        if "e" in result:
            e = result["e"]
            if isinstance(e, APIError):
                raise SandboxError(f"podman exec {shlex.join(argv)} failed: {e}") from e
            raise SandboxError(f"podman exec {shlex.join(argv)} failed: {e!r}") from e
        rc, (out, err) = result["r"]
        rc = 1 if rc is None else rc
        # coreutils `timeout` exits 124 on timeout, 137 if it had to KILL.
        timed_out = timeout is not None and rc in (124, 137) and time.monotonic() - t0 >= timeout
        return CommandResult(output=_decode(out), stderr=_decode(err), exit_code=124 if timed_out else rc,
                             timed_out=timed_out, duration_s=time.monotonic() - t0)

    def _abs(self, p: str) -> str:
        return p if p.startswith("/") else os.path.join(self.workdir or "/", p)

    def copy_in(self, src: Path, dst: str) -> None:
        """Copy a host file or directory so that it becomes exactly `dst` inside."""
        if self.container is None:
            raise SandboxError("sandbox is not started")
        src = Path(src)
        if not src.exists():
            raise SandboxError(f"copy_in: {src} does not exist")
        from podman.errors import APIError, NotFound

        dst = self._abs(dst).rstrip("/") or "/"
        parent, base = os.path.split(dst)
        parent = parent or "/"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(str(src), arcname=base)
        try:
            if self.container.put_archive(parent, buf.getvalue()):
                return
        except (NotFound, APIError):
            pass
        # Most targets' parent exists: only a refused archive pays for the mkdir exec.
        mk = self.exec(["mkdir", "-p", parent], user=IMAGE_USER)
        if mk.exit_code != 0:
            raise SandboxError(f"copy_in: cannot create {parent}: {mk.stderr.strip()}")
        try:
            ok = self.container.put_archive(parent, buf.getvalue())
        except (NotFound, APIError) as e:
            raise SandboxError(f"copy_in: podman refused the archive for {dst}: {e}") from e
        if not ok:
            raise SandboxError(f"copy_in: podman refused the archive for {dst}")

    def copy_out(self, src: str, dst: Path) -> None:
        """Copy `src` inside to exactly `dst` on the host (file or directory)."""
        if self.container is None:
            raise SandboxError("sandbox is not started")
        from podman.errors import APIError, NotFound

        src = self._abs(src).rstrip("/") or "/"
        try:
            stream, _stat = self.container.get_archive(src)
        except (NotFound, APIError) as e:
            raise SandboxError(f"copy_out: {src} not found in the container: {e}") from e
        dst = Path(dst)
        with tempfile.TemporaryDirectory(prefix=NAME_PREFIX + "copy-") as tmp:
            raw = Path(tmp) / "a.tar"
            with open(raw, "wb") as f:
                for chunk in stream:
                    f.write(chunk)
            out = Path(tmp) / "x"
            out.mkdir()
            with tarfile.open(raw) as tar:
                # The "data" filter refuses absolute paths, links out of the tree and devices.
                tar.extractall(out, filter="data")
            entries = list(out.iterdir())
            if len(entries) != 1:
                raise SandboxError(f"copy_out: unexpected archive layout for {src}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.is_dir() and entries[0].is_dir():
                shutil.copytree(entries[0], dst, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.move(str(entries[0]), str(dst))
