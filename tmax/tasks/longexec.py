"""Long harness commands (oracle solutions) inside a sandbox.

A solution can run for an hour. Rather than hold one exec request open that long (HTTP
clients time out, and a request cannot be cancelled), the command is started detached
inside the container and writes its exit status to a file. The exec that starts it then
waits for that file inside the container (checking every 50 ms, for at most WAIT_S), so
a short command costs one exec and returns as soon as it exits; a long one is waited for
by further execs of WAIT_S each. The same exec hands back the end of the command's log.
"""

from __future__ import annotations

import math
import shlex
import time
import uuid
from dataclasses import dataclass

from tmax.sandbox.base import Sandbox, SandboxError

WAIT_S = 50  # how long one exec waits inside the container for the command to end
GRACE_S = 30.0
MARKER = "TMAX-LONGEXEC-END"


@dataclass
class LongResult:
    exit_code: int
    timed_out: bool
    duration_s: float
    output: str = ""  # the last `tail_bytes` of the log


def _wait_script(rc_file: str, log_path: str, tail_bytes: int, pid: str) -> str:
    """Wait for `rc_file` for at most WAIT_S; then print the log's tail and a marker line
    `MARKER PID RC` (RC empty while the command still runs)."""
    tail = f"tail -c {tail_bytes} {shlex.quote(log_path)} 2>/dev/null; " if tail_bytes else ""
    return (f"while [ ! -f {rc_file} ] && [ $SECONDS -lt {WAIT_S} ]; do sleep 0.05; done; "
            f"if [ -f {rc_file} ]; then {tail}printf '\\n{MARKER} %s %s\\n' {pid} \"$(cat {rc_file})\"; "
            f"else printf '\\n{MARKER} %s \\n' {pid}; fi")


def _parse(output: str) -> tuple[str, str, str]:
    """(log tail, pid, rc or "") from a wait script's output."""
    body, sep, last = output.rpartition(f"\n{MARKER} ")
    if not sep:
        raise SandboxError(f"a long command in the sandbox did not report: {output[-500:]}".strip())
    pid, _, rc = last.strip().partition(" ")
    return body, pid, rc.strip()


def run_long(sandbox: Sandbox, command: str, timeout: float, workdir: str | None = None,
             env: dict[str, str] | None = None, log_path: str = "/dev/null", tail_bytes: int = 0) -> LongResult:
    """Run `command` (bash) with stdout+stderr to `log_path`; in-container `timeout` ends it
    on time and the wait loop is the backstop. SandboxError if it cannot be started."""
    tag = uuid.uuid4().hex[:12]
    rc_file = f"/tmp/.tmax-rc-{tag}"
    secs = int(math.ceil(timeout))
    inner = (f"timeout --kill-after=10 {secs} bash -c {shlex.quote(command)} > {shlex.quote(log_path)} 2>&1; "
             f"echo $? > {rc_file}.tmp && mv {rc_file}.tmp {rc_file}")
    launch = (f"nohup setsid bash -c {shlex.quote(inner)} </dev/null >/dev/null 2>&1 & pid=$!; "
              + _wait_script(rc_file, log_path, tail_bytes, "$pid"))
    t0 = time.monotonic()
    r = sandbox.exec(["bash", "-c", launch], timeout=WAIT_S + 60, workdir=workdir, env=env)
    if r.exit_code != 0 or MARKER not in r.output:
        raise SandboxError(f"could not start a command in the sandbox: {r.output[-500:]}{r.stderr}".strip())
    body, pid, rc = _parse(r.output)
    deadline = t0 + timeout + GRACE_S
    while not rc.lstrip("-").isdigit():
        if time.monotonic() > deadline:
            sandbox.exec(["bash", "-c", f"kill -KILL -{pid} 2>/dev/null; kill -KILL {pid} 2>/dev/null; true"], timeout=30)
            return LongResult(124, True, time.monotonic() - t0, body)
        r = sandbox.exec(["bash", "-c", _wait_script(rc_file, log_path, tail_bytes, pid)], timeout=WAIT_S + 60)
        body, _, rc = _parse(r.output)
    code = int(rc)
    return LongResult(code, code in (124, 137), time.monotonic() - t0, body)
