"""One-off host processes with a timeout, for the `exec` of the local and bwrap backends."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tmax.sandbox.base import CommandResult, SandboxError
from tmax.common.proctree import end_process_tree

T = TypeVar("T")

MAX_EXEC_CHARS = 10_000_000  # exec output is for harness code (verifiers), not a model


_lasting: ThreadPoolExecutor | None = None
_lasting_lock = threading.Lock()


def on_lasting_thread(fn: Callable[[], T]) -> T:
    """Run `fn` (which forks a child) on one thread that lives as long as the process.

    A parent-death signal (PR_SET_PDEATHSIG, e.g. bwrap's --die-with-parent) fires when
    the *thread* that forked the child exits, not the process. A shell (re)started from
    a short-lived worker thread would be killed the moment that thread ends; forking
    from this thread ties the child to the life of the process instead. The executor's
    single worker never exits while the process runs."""
    global _lasting
    with _lasting_lock:
        if _lasting is None:
            _lasting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tmax-spawner")
    return _lasting.submit(fn).result()


# Dispositions a child must not inherit: a job started in the background by a script
# ignores SIGINT and SIGQUIT, `nohup` ignores SIGHUP, Python itself ignores SIGPIPE. An
# ignored signal survives exec, and bash cannot undo what it inherited ignored, so Ctrl-C
# and timeouts would not stop a command in the sandbox.
_RESETTABLE = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


def default_signals() -> None:
    """For a forked child before exec: every signal at its default action, none blocked."""
    for sig in _RESETTABLE:
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass  # signals the C library reserves for itself
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@functools.cache
def _env_resetting_signals() -> list[str] | None:
    """`env --default-signal` (coreutils >= 8.31), which resets every disposition and
    execs its command; None where this host's env cannot."""
    env = shutil.which("env")
    if env is None or subprocess.run([env, "--default-signal", "true"], capture_output=True).returncode != 0:
        return None
    return [env, "--default-signal"]


def popen_default_signals(argv: list[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` whose child starts with every signal at its default action and
    none blocked, whatever this process inherited, without forking this process: Popen
    uses vfork unless Python must run in the child, and a fork of a driver holding torch
    costs it tens of ms of CPU and a page fault on every page it writes afterwards.

    The child inherits the spawning thread's mask, which is cleared for the moment of the
    spawn (Ray blocks SIGINT in its workers' threads). Ignored signals (a tmax started in the
    background ignores SIGINT and SIGQUIT) are reset by `env --default-signal` in front of
    argv; only where env cannot does Python run in the child. SIGPIPE and SIGXFSZ, which
    Python itself ignores, Popen's restore_signals resets."""
    restored = (signal.SIGPIPE, signal.SIGXFSZ)
    ignored = any(signal.getsignal(s) == signal.SIG_IGN for s in _RESETTABLE if s not in restored)
    prefix, preexec = [], None
    if ignored:
        prefix = _env_resetting_signals() or []
        preexec = None if prefix else default_signals
    if prefix:  # as Popen would: a missing program is an OSError here, not env's exit code 127
        path = (kwargs.get("env") or os.environ).get("PATH", os.defpath)
        program = shutil.which(argv[0], path=path)
        if program is None:
            raise FileNotFoundError(errno.ENOENT, f"No such file or directory: {argv[0]!r}")
        argv = [*prefix, program, *argv[1:]]
    blocked = signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        return subprocess.Popen(argv, preexec_fn=preexec, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _decode(b: bytes | None) -> str:
    return (b or b"")[-MAX_EXEC_CHARS:].decode("utf-8", errors="replace")


def run_process(argv: list[str], timeout: float | None = None, cwd: str | None = None,
                env: dict[str, str] | None = None) -> CommandResult:
    """Run argv with stdout and stderr captured separately. On timeout the whole process
    group is killed and exit code 124 is returned, like coreutils `timeout`."""
    t0 = time.monotonic()
    try:
        proc = popen_default_signals(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise SandboxError(f"could not run {argv[0]}: {e}") from e
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        end_process_tree(proc.pid, grace_s=0)
        out, err = proc.communicate()
        timed_out, rc = True, 124
    if rc is not None and rc < 0:
        rc = 128 - rc  # killed by a signal: report it the way a shell does
    return CommandResult(output=_decode(out), stderr=_decode(err), exit_code=rc, timed_out=timed_out,
                         duration_s=time.monotonic() - t0)
