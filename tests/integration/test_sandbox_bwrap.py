"""The bubblewrap backend on real bwrap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tmax.sandbox import SandboxError, SandboxSpec, make_sandbox
from tmax.sandbox.bwrap import available

pytestmark = [pytest.mark.bwrap, pytest.mark.skipif(not available(), reason="bubblewrap is not installed")]


@pytest.fixture
def jail(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    sb = make_sandbox("bwrap", SandboxSpec(workspace=ws, workspace_target="/workspace", env={"FOO": "bar"}))
    sb.start()
    yield sb
    sb.close()


def test_workspace_writable_host_read_only(jail, tmp_path):
    r = jail.run("pwd; echo $FOO; echo data > out.txt")
    assert r.output == "/workspace\nbar\n" and r.exit_code == 0
    assert (tmp_path / "ws" / "out.txt").read_text() == "data\n"
    for path in ("/etc/tmax-probe", "/usr/tmax-probe", "/tmax-probe", "/var/tmax-probe"):
        r = jail.run(f"touch {path}")
        assert r.exit_code != 0 and "Read-only file system" in r.output, path
    assert not Path("/var/tmax-probe").exists()


def test_private_tmp_shared_with_exec(jail, tmp_path):
    marker = Path("/tmp") / f"tmax-host-probe-{os.getpid()}"
    marker.write_text("host")
    try:
        assert jail.run(f"ls {marker}").exit_code != 0
    finally:
        marker.unlink()
    jail.run("echo shell-wrote > /tmp/shared.txt")
    r = jail.exec(["cat", "/tmp/shared.txt"])
    assert r.output == "shell-wrote\n" and r.exit_code == 0


def test_no_network_by_default(jail):
    r = jail.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert r.output.split() == ["lo"]


def test_network_when_asked(tmp_path):
    sb = make_sandbox("bwrap", SandboxSpec(network=True))
    sb.start()
    try:
        ifaces = sb.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '").output.split()
        assert len(ifaces) > 1
    finally:
        sb.close()


def test_pid_namespace_and_clean_environment(jail, monkeypatch):
    r = jail.run("echo $$; ls /proc | grep -E '^[0-9]+$' | wc -l")
    pid, nprocs = r.output.split()
    assert int(pid) < 10 and int(nprocs) < 10
    # The host environment (e.g. API keys) does not leak in, for the shell or exec.
    monkeypatch.setenv("TMAX_SECRET_PROBE", "s3cret")
    assert "s3cret" not in jail.exec(["env"]).output
    assert "s3cret" not in jail.run("env").output


def test_copy_in_out_and_readonly_targets(jail, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("in")
    jail.copy_in(src, "/workspace/sub/in.txt")
    jail.copy_in(src, "/tmp/t.txt")
    assert jail.run("cat sub/in.txt /tmp/t.txt").output == "inin"
    jail.copy_out("/tmp/t.txt", tmp_path / "back.txt")
    assert (tmp_path / "back.txt").read_text() == "in"
    with pytest.raises(SandboxError, match="read-only"):
        jail.copy_in(src, "/etc/x")


def test_timeout_recovery_in_jail(jail):
    r = jail.run("sleep 50", timeout=1)
    assert r.timed_out and r.exit_code == 124
    assert jail.run("echo alive").output == "alive\n"


def test_close_removes_temp_dirs(tmp_path):
    sb = make_sandbox("bwrap", SandboxSpec())
    sb.start()
    own = sb._own_dir
    assert own and Path(own).is_dir()
    sb.close()
    assert not Path(own).exists()
    sb.close()  # idempotent


def test_dies_with_parent(tmp_path):
    """A sandbox whose tmax process is SIGKILLed leaves no process behind."""
    tag = f"tmax-orphan-probe-{os.getpid()}"
    script = textwrap.dedent(f"""
        import sys, time
        from tmax.sandbox import make_sandbox, SandboxSpec
        sb = make_sandbox("bwrap", SandboxSpec())
        sb.start()
        sb.run("exec -a {tag} sleep 300 &")
        print("ready", sb._own_dir, flush=True)
        time.sleep(300)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         cwd=str(Path(__file__).resolve().parents[2]))
    try:
        word, own_dir = p.stdout.readline().split()
        assert word == "ready"

        def probe_alive() -> bool:
            return subprocess.run(["pgrep", "-f", tag], capture_output=True).returncode == 0

        assert probe_alive()
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while probe_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not probe_alive()
    finally:
        if p.poll() is None:
            p.kill()
        if "own_dir" in locals():
            import shutil

            shutil.rmtree(own_dir, ignore_errors=True)
