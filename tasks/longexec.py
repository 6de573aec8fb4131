"""Long harness commands (oracle solutions, verifiers) inside a sandbox.

A verifier can run for an hour. Rather than hold one exec request open that long (HTTP
clients time out, and a request cannot be cancelled), the command is started detached
inside the container, writes its exit status to a file, and is polled with short execs.
"""

from __future__ import annotations

import math
import shlex
import time
import uuid
from dataclasses import dataclass

from sandbox.base import Sandbox, SandboxError
from sandbox.waiting import wait_until

POLL_S = (0.3, 3.0)  # first and longest interval between polls (growing by half each time)
GRACE_S = 30.0


@dataclass
class LongResult:
    exit_code: int
    timed_out: bool
    duration_s: float


def run_long(sandbox: Sandbox, command: str, timeout: float, workdir: str | None = None,
             env: dict[str, str] | None = None, log_path: str = "/dev/null") -> LongResult:
    """Run `command` (bash) with stdout+stderr to `log_path`; in-container `timeout` ends it
    on time and the poll loop is the backstop. SandboxError if it cannot be started."""
    tag = uuid.uuid4().hex[:12]
    rc_file = f"/tmp/.tmax-rc-{tag}"
    secs = int(math.ceil(timeout))
    inner = (f"timeout --kill-after=10 {secs} bash -c {shlex.quote(command)} > {shlex.quote(log_path)} 2>&1; "
             f"echo $? > {rc_file}.tmp && mv {rc_file}.tmp {rc_file}")
    launch = f"nohup setsid bash -c {shlex.quote(inner)} </dev/null >/dev/null 2>&1 & echo $!"
    t0 = time.monotonic()
    r = sandbox.exec(["bash", "-c", launch], timeout=60, workdir=workdir, env=env)
    if r.exit_code != 0 or not r.output.strip().isdigit():
        raise SandboxError(f"could not start a command in the sandbox: {r.output}{r.stderr}".strip())
    pid = r.output.strip()

    def exit_status() -> tuple[int] | None:  # a tuple: an exit status of 0 is an answer too
        p = sandbox.exec(["cat", rc_file], timeout=30)
        ok = p.exit_code == 0 and p.output.strip().lstrip("-").isdigit()
        return (int(p.output.strip()),) if ok else None

    done = wait_until(exit_status, t0 + timeout + GRACE_S - time.monotonic(), *POLL_S)
    if done:
        return LongResult(done[0], done[0] in (124, 137), time.monotonic() - t0)
    sandbox.exec(["bash", "-c", f"kill -KILL -{pid} 2>/dev/null; kill -KILL {pid} 2>/dev/null; true"], timeout=30)
    return LongResult(124, True, time.monotonic() - t0)
