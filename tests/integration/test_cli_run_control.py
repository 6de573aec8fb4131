"""`tmax run` under a user's control: commands that can be bounded and stopped (also when
tmax runs in the background of a script), programs that need a terminal, resumed
sessions, long outputs and secrets. The real CLI, real shells and a scripted model server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripted_server import ScriptedServer
from test_cli_run import FOLLOW_UP, GUIDANCE, SUBMIT, env, run_args, run_json, spawn, ws  # noqa: F401  (fixtures)
from tmax.cli.run_settings import bwrap_works

JAIL = "bwrap" if bwrap_works() else "local"


def _alive(marker: str) -> bool:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0


def _wait_alive(marker: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while not _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(marker)


def _wait_gone(marker: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(marker)


def test_background_run_is_interruptible_and_time_boxed(env, ws, tmp_path):
    """Started with `&` from a script (SIGINT ignored on entry): the jail's commands still
    get default signals, --command-timeout stops a command without losing the shell, and
    SIGINT stops the run; a command that ignores Ctrl-C dies with the second one."""
    marker = f"4{os.getpid() % 1000}.{time.monotonic_ns() % 1000}"
    script = [
        {"bash": "export K=kept; sh -c 'grep SigIgn /proc/self/status'"},
        {"bash": "sleep 100"},
        {"bash": "echo K=$K"},
        {"bash": f"bash -c \"trap '' INT; sleep {marker}\""},
    ]
    with ScriptedServer(script) as srv:
        args = run_args(srv, ws, tmp_path / "run", "--env", JAIL, "--command-timeout", "5")
        cmd = " ".join([sys.executable, "-m", "tmax.cli.main", "run", "--json", *(f"'{a}'" for a in args)])
        proc = subprocess.Popen(["bash", "-c", f"{cmd} & echo $!; wait $!"], env=env, cwd=str(ws),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        tmax_pid = int(proc.stdout.readline())
        # bash prints the pid right after its fork, before the child sets its dispositions
        # and execs: read them once the child runs Python (until its exec the child's argv
        # is bash's own, which names tmax.cli.main in its -c string).
        deadline = time.monotonic() + 10
        while (Path(f"/proc/{tmax_pid}/cmdline").read_bytes().split(b"\0")[0] != sys.executable.encode()
               and time.monotonic() < deadline):
            time.sleep(0.01)
        status = Path(f"/proc/{tmax_pid}/status").read_text()
        # The premise: started with SIGINT and SIGQUIT ignored. tmax soon handles SIGINT
        # itself, so SIGQUIT, which it leaves alone, is the one that shows it.
        assert int(status.split("SigIgn:")[1].split()[0], 16) & (1 << (signal.SIGQUIT - 1))
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["type"] == "command" and marker in events[-1]["command"]:
                assert _wait_alive(marker, 10)
                os.kill(tmax_pid, signal.SIGINT)
                time.sleep(1)
                assert _alive(marker)  # it ignores Ctrl-C...
                started = time.monotonic()
                os.kill(tmax_pid, signal.SIGINT)  # ...so the second one kills its process group
        proc.wait(timeout=60)
    observations = [e for e in events if e["type"] == "observation"]
    assert events[-1]["status"] == "interrupted" and proc.returncode == 130, proc.stderr.read()
    assert observations[0]["observation"].startswith("SigIgn:\t0000000000000000")
    assert observations[1]["timed_out"] and "timed out after 5 s and was interrupted" in observations[1]["note"]
    assert observations[2]["observation"].startswith("K=kept")  # the same shell, not a restarted one
    assert observations[3]["exit_code"] == 137 and time.monotonic() - started < 10
    assert _wait_gone(marker, 5)


def test_ctrl_c_stops_a_slow_model_call_when_started_with_sigint_blocked(env, ws, tmp_path):
    """A parent that blocks SIGINT (a Ray worker, some job runners) passes the block on
    through exec: Ctrl-C must still interrupt the model call at once, not stay pending."""
    block_then_exec = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
                       "os.execv(sys.executable, sys.argv[1:])")
    with ScriptedServer([{"delay": 20, "bash": "echo slow"}]) as srv:
        args = run_args(srv, ws, tmp_path / "run", "--env", JAIL)
        proc = subprocess.Popen([sys.executable, "-c", block_then_exec, sys.executable, "-m", "tmax.cli.main", "run",
                                 "--json", *args], env=env, cwd=str(ws), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 30
        while not srv.requests and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert srv.requests, proc.stderr.read() if proc.poll() is not None else "no model call"
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        waited = time.monotonic() - pressed
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1]["status"] == "interrupted" and proc.returncode == 130, err
    assert waited < 10 and not any(e["type"] == "command" for e in events)


def test_sigterm_stops_a_command_that_ignores_ctrl_c(env, ws, tmp_path):
    """A supervisor's time box (`timeout`, a CI limit) ends the run and the command at once."""
    marker = f"5{os.getpid() % 1000}.{time.monotonic_ns() % 1000}"
    with ScriptedServer([{"bash": f"bash -c \"trap '' INT; sleep {marker}\""}]) as srv:
        args = run_args(srv, ws, tmp_path / "run", "--env", JAIL)
        proc = subprocess.Popen([sys.executable, "-m", "tmax.cli.main", "run", "--json", *args], env=env, cwd=str(ws),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["type"] == "command":
                assert _wait_alive(marker, 10)
                started = time.monotonic()
                proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 130 and events[-1]["status"] == "interrupted", proc.stderr.read()
    assert time.monotonic() - started < 10
    assert _wait_gone(marker, 5)


@pytest.mark.skipif(JAIL != "bwrap", reason="bubblewrap cannot run here")
@pytest.mark.bwrap
def test_vi_fails_fast_and_restarts_keep_the_shell_persistent(env, ws, tmp_path):
    script = [{"bash": "mkdir -p d && cd d && export A=before-vi"}, {"bash": "vi notes.txt"}, {"bash": "echo A=$A; pwd"},
              {"bash": "git init -q . && git -c user.name=t -c user.email=t@t commit -q --allow-empty 2>&1 | head -1;"
                      " less /etc/hostname | wc -l"}, {"bash": SUBMIT}]
    with ScriptedServer(script) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "bwrap"), env, ws)
    assert rc == 0, stderr
    vi, probe, others = [e for e in events if e["type"] == "observation"][1:4]
    assert vi["exit_code"] == 1 and vi["duration_s"] < 5 and "vi needs an interactive terminal" in vi["observation"]
    assert probe["observation"] == f"A=before-vi\n{ws}/d\n\n(exit_code=0)"
    assert others["observation"].startswith("tmax: an editor needs an interactive terminal")
    assert others["observation"].splitlines()[-3] == "1"  # a pager prints straight through


def test_model_timeout_flag_and_the_url_in_model_errors(env, ws, tmp_path):
    with ScriptedServer([{"delay": 3, "bash": "echo late"}, {"bash": SUBMIT}]) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "local", "--model-timeout", "1"), env, ws)
    assert rc == 0, stderr
    retry = next(e for e in events if e["type"] == "retry")
    assert "timed out" in retry["error"] and srv.base_url in retry["error"]


def test_max_tokens_flag_and_the_servers_window(env, ws, tmp_path):
    with ScriptedServer([{"bash": SUBMIT}], max_model_len=4096) as srv:
        rc, _, stderr = run_json(run_args(srv, ws, tmp_path / "r1", "--env", "local"), env, ws)
        assert rc == 0, stderr
        assert srv.requests[0]["max_tokens"] == 4096  # not the 16,384 vLLM would refuse
    with ScriptedServer([{"bash": SUBMIT}]) as srv:
        rc, _, stderr = run_json(run_args(srv, ws, tmp_path / "r2", "--env", "local", "--max-tokens", "123"), env, ws)
        assert rc == 0 and srv.requests[0]["max_tokens"] == 123, stderr


def test_resume_from_another_directory_uses_the_saved_workdir(env, ws, tmp_path):
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    elsewhere.mkdir()
    with ScriptedServer([{"bash": "echo saved > state.txt"}, {"bash": SUBMIT}]) as srv:
        assert run_json(run_args(srv, ws, first, "--env", "local"), env, ws)[0] == 0
    with ScriptedServer([{"bash": "cat state.txt; pwd"}, {"bash": SUBMIT}]) as srv:
        args = ["--base-url", srv.base_url, "--model", srv.model, "--env", "local", "--resume", str(first),
                "-o", str(tmp_path / "second"), "go on"]
        rc, events, stderr = run_json(args, env, elsewhere)
    assert rc == 0, stderr
    assert events[0]["workdir"] == str(ws)
    assert [e for e in events if e["type"] == "observation"][0]["observation"].startswith(f"saved\n{ws}\n")
    # The saved directory is gone: refused, saying why, instead of running somewhere else.
    (ws / "state.txt").unlink()
    ws.rmdir()
    rc, events, stderr = run_json(args[:-3] + ["-o", str(tmp_path / "third"), "go on"], env, elsewhere)
    assert rc == 2 and f"its working directory {ws} no longer exists" in stderr


def test_long_output_is_kept_in_the_run_directory(env, ws, tmp_path):
    with ScriptedServer([{"bash": "seq 1 100000"}, {"bash": SUBMIT}]) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
    assert rc == 0, stderr
    obs = [e for e in events if e["type"] == "observation"][0]
    assert "chars elided" in obs["observation"]  # the model saw head and tail
    kept = Path(obs["output_file"])
    assert kept.parent == tmp_path / "run" / "outputs"
    assert kept.read_text().split() == [str(i) for i in range(1, 100001)]


@pytest.mark.skipif(JAIL != "bwrap", reason="bubblewrap cannot run here")
@pytest.mark.bwrap
def test_bwrap_jail_masks_the_config_file_and_credentials(env, ws, tmp_path):
    cfg = ws / "cfg" / "tmax" / "config.toml"  # inside the workspace, so the jail would show it
    cfg.parent.mkdir(parents=True)
    home = ws / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("ssh-secret")
    (home / ".netrc").write_text("netrc-secret")
    show = f"cat {cfg} {home}/.ssh/id_ed25519 {home}/.netrc; ls {home}/.ssh; echo done"
    for expose, ssh_shown in (([], False), (["--expose", str(home / ".ssh")], True)):
        with ScriptedServer([{"bash": show}, {"bash": SUBMIT}]) as srv:
            cfg.write_text(f'base_url = "{srv.base_url}"\napi_key = "cfg-secret"\n')
            e = dict(env, XDG_CONFIG_HOME=str(ws / "cfg"), HOME=str(home))
            rc, events, stderr = run_json(["--workdir", str(ws), "-o", str(tmp_path / f"r{len(expose)}"), "--env", "bwrap",
                                           *expose, "go"], e, ws)
        assert rc == 0, stderr
        seen = [x for x in events if x["type"] == "observation"][0]["observation"]
        assert "cfg-secret" not in seen and "netrc-secret" not in seen and "done" in seen
        assert ("ssh-secret" in seen) == ssh_shown, seen


def test_screen_names_the_kept_output_and_a_second_ctrl_c_kills(env, ws, tmp_path, spawn):
    marker = f"6{os.getpid() % 1000}.{time.monotonic_ns() % 1000}"
    script = [{"bash": "seq 1 3000"}, {"bash": f"bash -c \"trap '' INT; sleep {marker}\""}, {"bash": SUBMIT}]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
        t.expect("all of it is in")
        assert _wait_alive(marker, 30)
        t.child.sendintr()
        time.sleep(1)
        assert _alive(marker)  # the command ignores Ctrl-C...
        t.child.sendintr()  # ...the second one kills its process group
        t.answer(GUIDANCE, "carry on")
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        requests = srv.requests
    # Without whitespace and the panel's borders: a long path wraps inside the output panel on
    # a narrow screen (a pytest-xdist worker passes on a COLUMNS of 80, say).
    unwrapped = "".join(c for c in t.screen if not c.isspace() and c != "│")
    assert "wholeoutput:" + str(tmp_path / "run" / "outputs" / "step-1.txt") in unwrapped
    assert "(exit_code=137)" in requests[2]["messages"][-2]["content"]
    assert not _alive(marker)
