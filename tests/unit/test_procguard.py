"""The process guard ends a server's whole process group when its owner is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

GUARD = Path(__file__).resolve().parents[2] / "tmax" / "training" / "inference" / "procguard.py"


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie still answers kill(0); it is gone for our purposes.
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _owner_script(pidfile: Path) -> str:
    # The owner starts the guard the way VLLMServer does (new session), then waits to be killed.
    # The guarded command forks a grandchild, like vLLM's API server forks its engine core.
    cmd = ["bash", "-c", f"sleep 300 & echo $! > {pidfile}; wait"]
    return textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, {str(GUARD)!r}, str(os.getpid()), "--"] + {cmd!r},
                         start_new_session=True)
        time.sleep(300)
    """)


def test_grandchild_dies_with_a_killed_owner(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    owner = subprocess.Popen([sys.executable, "-c", _owner_script(pidfile)])
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.is_file() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        grandchild = int(pidfile.read_text())
        assert not _gone(grandchild, 1.0), "the guarded command's child should run while its owner lives"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _gone(grandchild, 15.0), "the guard left the grandchild running after its owner was killed"
    finally:
        owner.kill()


def test_grandchild_dies_with_a_killed_command(tmp_path: Path) -> None:
    # A vLLM API server SIGKILLed under its engine core: the guard ends the orphan too.
    pidfile = tmp_path / "grandchild.pid"
    owner_pid = os.getpid()
    guard = subprocess.Popen([sys.executable, str(GUARD), str(owner_pid), "--", "bash", "-c",
                              f"sleep 300 & echo $! > {pidfile}; wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.is_file() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        grandchild = int(pidfile.read_text())
        [command] = psutil.Process(guard.pid).children()  # bash; the sleep is its child
        os.kill(command.pid, signal.SIGKILL)
        assert guard.wait(timeout=30) == 128 + signal.SIGKILL
        assert _gone(grandchild, 15.0), "the guard left the command's child running after the command was killed"
    finally:
        guard.kill()


def test_exit_status_passes_through(tmp_path: Path) -> None:
    rc = subprocess.run([sys.executable, str(GUARD), str(os.getpid()), "--", "bash", "-c", "exit 7"], timeout=30).returncode
    assert rc == 7


def test_usage_error() -> None:
    r = subprocess.run([sys.executable, str(GUARD), "notapid", "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr


def test_server_alive_follows_the_guarded_process_across_a_restart(tmp_path: Path) -> None:
    """`VLLMServer.alive` under its real guard, the server replaced by a `sleep`: alive while
    the command runs, not once it is killed (the guard then ends too), and alive again
    after a new start (the server it remembered is gone)."""
    import dataclasses

    from tmax.training.inference.serving import ServeSpec, VLLMServer
    from tmax.training.net import free_port

    srv = VLLMServer(ServeSpec(model="some/model", port=free_port(), device="cpu"), log_path=tmp_path / "log")
    srv.command = dataclasses.replace(srv.command, argv=["sleep", "300"])
    try:
        for _ in range(2):
            srv.start()
            deadline = time.monotonic() + 10
            while not srv.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert srv.alive()
            (server,) = psutil.Process(srv.proc.pid).children()
            assert srv.alive() and srv._server.pid == server.pid
            server.kill()
            assert _gone(server.pid, 10)
            deadline = time.monotonic() + 10
            while srv.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not srv.alive()
            srv.stop(grace_s=5)
    finally:
        srv.stop(grace_s=1)
