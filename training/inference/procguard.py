"""Run a command and end its whole process group when the owning process dies.

    python training/inference/procguard.py OWNER_PID -- COMMAND [ARG ...]

Why: a vLLM server forks an engine core, which forks workers. When the process that owns
the server is SIGKILLed (a Ray actor killed by `ray.kill` or `ray.shutdown`), no atexit
hook runs, and PR_SET_PDEATHSIG cannot help from a Ray actor: the kernel ties it to the
*thread* that forked, and actor methods run on threads that come and go. Left alone, the
engine core keeps its GBs of memory and a CPU core after its API server is gone.

The guard is the process-group leader (the caller starts it in a new session), runs the
command as its child in the same group, and polls the owner. When the owner is gone it
sends SIGTERM to the group, then SIGKILL after a grace period. It exits with the
command's status, so the caller sees the server's exit code as before. Stdlib only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 1.0
GRACE_S = 20.0


# Like sandbox.podman_service's liveness check, written again on purpose: the guard runs as
# a script by file path, outside the package, and must import nothing but the stdlib.
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(grace_s: float, child: subprocess.Popen) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard outlives its own SIGTERM to finish the job
    pgid = os.getpgrp()
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Grandchildren (engine core, workers) may outlive the server: end the group. The guard
    # is in the group too, so this is its last act.
    os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: procguard.py OWNER_PID -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    owner, command = int(argv[0]), argv[2:]
    parent = os.getppid()
    child = subprocess.Popen(command)  # inherits stdio, env, cwd and the process group

    def on_term(signum: int, frame: object) -> None:
        _end_group(GRACE_S, child)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        try:
            rc = child.wait(timeout=POLL_S)
            return rc if rc >= 0 else 128 - rc
        except subprocess.TimeoutExpired:
            pass
        if not _alive(owner) or os.getppid() != parent:
            _end_group(GRACE_S, child)
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
