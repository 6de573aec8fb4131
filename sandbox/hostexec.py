"""One-off host processes with a timeout, for the `exec` of the local and bwrap backends."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from sandbox.base import CommandResult, SandboxError

MAX_EXEC_CHARS = 10_000_000  # exec output is for harness code (verifiers), not a model


def _decode(b: bytes | None) -> str:
    return (b or b"")[-MAX_EXEC_CHARS:].decode("utf-8", errors="replace")


def run_process(argv: list[str], timeout: float | None = None, cwd: str | None = None,
                env: dict[str, str] | None = None) -> CommandResult:
    """Run argv with stdout and stderr captured separately. On timeout the whole process
    group is killed and exit code 124 is returned, like coreutils `timeout`."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise SandboxError(f"could not run {argv[0]}: {e}") from e
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        timed_out, rc = True, 124
    if rc is not None and rc < 0:
        rc = 128 - rc  # killed by a signal: report it the way a shell does
    return CommandResult(output=_decode(out), stderr=_decode(err), exit_code=rc, timed_out=timed_out,
                         duration_s=time.monotonic() - t0)
