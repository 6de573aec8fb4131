"""The podman REST service that podman-py talks to, and tmax's one way of asking podman.

One client: podman-py, against this service. Every container, image and exec call goes
through `client()`: an HTTP call to a service that holds podman's stores open, where each
`podman` CLI process opens them again (the CLI as a client of this service, `--url`, still
starts a process per call: benchmarks/podman_client_cost.py measures both side by side; on
the shared 2-core machine, per call, podman-py against the CLI: an existence check 1.7 against
38 ms, an exec 109 against 136 ms, a container's life 275 against 400 ms, with 1-5 against
25-87 ms of the caller's CPU, docs/results/podman_client_cost.jsonl).
The podman binary is run only for what the REST API cannot do from Python: starting this
service, the agent's interactive shell (`podman --url exec -it`, a pty, as a client of this
service), image builds (`podman build`, its log streamed to a file, cancelled on Ctrl-C),
the base image's build (`podman import` of its root tree, its smoke run), and a one-off
container's binary stdout (the undo's originals, a tar stream) -- and, as a last resort, where
the service no longer answers (a container left after a failed remove, a host's end awaited
after a Ctrl-C).

When no socket is configured (`TMAX_PODMAN_SOCKET`, else `CONTAINER_HOST`), tmax starts
`podman --runtime runc system service --time=0 unix://<fresh path>` itself, once per
process, and stops it at exit. `--runtime` must be given to the *service*: podman 4.3
ignores the per-container runtime field of the REST API. Each service gets a fresh socket
path, because a stopping service unlinks its socket path even when a newer service has
re-bound it. It is stopped by the PID of the `podman` process itself (no wrapper shell).

Each service directory also records the owning tmax PID, so `tmax sandbox clean` can
stop services whose owner died without running its exit handlers.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import psutil

from tmax.sandbox.base import NAME_PREFIX, SandboxError
from tmax.sandbox.hostexec import on_lasting_thread
from tmax.common.proctree import parent_death_hook
from tmax.common.waiting import wait_until

DEFAULT_RUNTIME = "runc"
SERVICE_DIR_PREFIX = NAME_PREFIX + "podman-"
START_TIMEOUT_S = 30.0


def configured_url() -> str | None:
    """The socket URL from the environment, if any."""
    sock = os.environ.get("TMAX_PODMAN_SOCKET") or os.environ.get("CONTAINER_HOST")
    if not sock:
        return None
    return sock if "://" in sock else "unix://" + sock


def ping(url: str, timeout: float = 2.0) -> bool:
    from podman import PodmanClient

    try:
        with PodmanClient(base_url=url, timeout=timeout) as c:
            return bool(c.ping())
    except Exception:
        return False


def _spawn_tied_to_process(argv: list[str], **kw) -> subprocess.Popen:
    """Popen whose child is signalled if this process dies, even by SIGKILL (when exit
    handlers never run); forked on the lasting thread so the signal follows the process."""
    try:
        return on_lasting_thread(lambda: subprocess.Popen(argv, preexec_fn=parent_death_hook(), **kw))
    except Exception as e:
        raise SandboxError(f"could not start the podman service: {e}") from e


class PodmanService:
    """A `podman system service` owned by this process."""

    def __init__(self, runtime: str = DEFAULT_RUNTIME, base_dir: str | None = None):
        self.runtime = runtime
        self.base_dir = base_dir
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        if shutil.which("podman") is None:
            raise SandboxError("podman is not installed")
        self.dir = Path(tempfile.mkdtemp(prefix=SERVICE_DIR_PREFIX, dir=self.base_dir))
        sock = self.dir / "podman.sock"
        self.url = f"unix://{sock}"
        log = open(self.dir / "service.log", "wb")
        try:
            self.proc = _spawn_tied_to_process(
                ["podman", "--runtime", self.runtime, "system", "service", "--time=0", self.url],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal must not kill it mid-run
                # conmon, started by the service for each container and exec, writes `oom`
                # into its working directory when a process is OOM-killed: in this
                # service's own directory, not the user's project.
                cwd=self.dir,
            )
        finally:
            log.close()
        (self.dir / "service.pid").write_text(str(self.proc.pid))
        (self.dir / "owner.pid").write_text(str(os.getpid()))
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise _Exited()
            return sock.exists() and ping(self.url)

        try:
            if wait_until(up, timeout, 0.1):
                return self.url
        except _Exited:
            pass
        tail = (self.dir / "service.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise SandboxError(f"podman service did not come up on {self.url}: {tail}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


_lock = threading.Lock()
_service: PodmanService | None = None


def service_url(runtime: str = DEFAULT_RUNTIME) -> str:
    """The URL of the configured service, else of this process's own (started once)."""
    global _service
    url = configured_url()
    if url:
        return url
    with _lock:
        if _service is None or _service.proc is None or _service.proc.poll() is not None:
            if _service is not None:
                _service.stop()
            svc = PodmanService(runtime)
            svc.start()
            _service = svc
            atexit.register(stop_service)
        return _service.url


def prestart(runtime: str = DEFAULT_RUNTIME) -> None:
    """Import podman-py and start the service on a background thread, so that a caller who
    will need them soon overlaps that with other work. Errors surface at the first real use."""
    def work() -> None:
        try:
            import podman  # noqa: F401

            service_url(runtime)
        except Exception:
            pass

    threading.Thread(target=work, daemon=True, name="tmax-podman-prestart").start()


def stop_service() -> None:
    global _service
    with _lock:
        if _service is not None:
            _service.stop()
            _service = None


def client(runtime: str = DEFAULT_RUNTIME, timeout: float | None = 120):
    """A podman-py client for the service."""
    from podman import PodmanClient

    return PodmanClient(base_url=service_url(runtime), timeout=timeout)


class _Exited(Exception):
    """The service process ended while it was awaited."""


def _stop_pid(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM `pid` and give it `grace_s` to exit."""
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=grace_s)
    except (psutil.Error, psutil.TimeoutExpired):
        pass


def clean_stale_services(base_dir: str | None = None) -> list[str]:
    """Stop services whose owning tmax process is gone; returns the directories removed."""
    root = Path(base_dir or tempfile.gettempdir())
    removed = []
    for d in sorted(root.glob(SERVICE_DIR_PREFIX + "*")):
        try:
            owner = int((d / "owner.pid").read_text())
            pid = int((d / "service.pid").read_text())
        except (OSError, ValueError):
            owner, pid = -1, -1
        if owner > 0 and psutil.pid_exists(owner):
            continue
        if pid > 0 and psutil.pid_exists(pid):
            # Only signal the PID if it is still the service on this directory's socket.
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                cmdline = ""
            if str(d / "podman.sock") in cmdline:
                _stop_pid(pid)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed
