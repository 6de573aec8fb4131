"""Run a command and end its whole process group when the owning process dies.

    python training/inference/procguard.py OWNER_PID -- COMMAND [ARG ...]

Why: a vLLM server forks an engine core, which forks workers. When the process that owns
the server is SIGKILLed (a Ray actor killed by `ray.kill` or `ray.shutdown`), no atexit
hook runs, and PR_SET_PDEATHSIG cannot help from a Ray actor: the kernel ties it to the
*thread* that forked, and actor methods run on threads that come and go. Left alone, the
engine core keeps its GBs of memory and a CPU core after its API server is gone.

The guard is the process-group leader (the caller starts it in a new session), runs the
command as its child in the same group, and polls the owner. When the owner is gone it
ends everything else in the group (`sandbox.proctree.end_process_tree`: SIGTERM, then
SIGKILL after a grace period). So it does when the command itself dies (an API server
killed under its engine core, which would otherwise run on, orphaned, holding its memory
and a core). It exits with the command's status, so the caller sees the server's exit
code as before. It runs as a script by file path, with the interpreter of the installed
package.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tmax.common.proctree import end_process_tree, parent_death_hook

POLL_S = 1.0
GRACE_S = 20.0
# What a dead command left in its group (an engine core without its API server) gets less.
ORPHAN_GRACE_S = 5.0


def _end_group(grace_s: float, child: subprocess.Popen) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard outlives its own SIGTERM to finish the job
    # Grandchildren (engine core, workers) may outlive the server: the whole group the guard leads.
    end_process_tree(os.getpid(), grace_s)
    child.poll()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: procguard.py OWNER_PID -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    owner, command = int(argv[0]), argv[2:]
    parent = os.getppid()
    # Inherits stdio, env, cwd and the process group; SIGTERMed should the guard itself be
    # SIGKILLed (Ray kills a dying worker's children), so the server never runs unguarded.
    child = subprocess.Popen(command, preexec_fn=parent_death_hook())

    def on_term(signum: int, frame: object) -> None:
        _end_group(GRACE_S, child)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        try:
            rc = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        else:
            _end_group(ORPHAN_GRACE_S, child)  # what the command started and left behind
            return rc if rc >= 0 else 128 - rc
        if not psutil.pid_exists(owner) or os.getppid() != parent:
            _end_group(GRACE_S, child)
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
