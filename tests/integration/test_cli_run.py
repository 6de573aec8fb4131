"""`tmax run` end to end: the real CLI process in a real pty (pexpect) or as a headless
subprocess, a real shell sandbox, and a real HTTP model server replaying scripted turns.
Assertions look at what the user sees, what the model server received, and what the
commands did on disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from scripted_server import ScriptedServer
from tmax.cli.run_settings import bwrap_works

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
APPROVE = "reject with feedback"  # part of the confirm prompt
GUIDANCE = "Guidance for the agent"
FOLLOW_UP = "Follow-up task"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def plain(text: str) -> str:
    return _ANSI.sub("", text)


@pytest.fixture
def env(tmp_path):
    """A clean environment: no model settings from the caller, private config/data dirs."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    e.update(
        XDG_CONFIG_HOME=str(tmp_path / "cfg"),
        XDG_DATA_HOME=str(tmp_path / "data"),
        TERM="xterm",
        NO_COLOR="1",
        # pexpect does not answer prompt-toolkit's cursor-position request.
        PROMPT_TOOLKIT_NO_CPR="1",
    )
    return e


@pytest.fixture
def ws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    return d


class Tmax:
    """`python -m tmax.cli.main run ...` in a pty, with the transcript kept for assertions."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 30) -> None:
        self.log: list[str] = []
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "tmax.cli.main", "run", *args],
            env=env,
            cwd=str(cwd),
            encoding="utf-8",
            codec_errors="replace",
            dimensions=(50, 160),
            timeout=timeout,
        )
        self.child.logfile_read = self  # pexpect calls write()/flush()

    def write(self, s: str) -> None:
        self.log.append(s)

    def flush(self) -> None:
        pass

    @property
    def screen(self) -> str:
        return plain("".join(self.log))

    def expect(self, pattern: str, timeout: float | None = None) -> None:
        try:
            self.child.expect(pattern, timeout=timeout if timeout is not None else -1)
        except (pexpect.TIMEOUT, pexpect.EOF) as e:
            raise AssertionError(f"{pattern!r} not seen ({type(e).__name__}); screen:\n{self.screen[-4000:]}") from None

    def answer(self, prompt: str, text: str) -> None:
        self.expect(prompt)
        self.child.sendline(text)

    def finish(self) -> int:
        self.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture
def spawn():
    started: list[Tmax] = []

    def _spawn(args, env, cwd, timeout=30):
        t = Tmax(args, env, cwd, timeout)
        started.append(t)
        return t

    yield _spawn
    for t in started:
        t.kill()


def run_args(srv: ScriptedServer, ws: Path, out: Path, *extra: str, task: str = "do the task") -> list[str]:
    return ["--base-url", srv.base_url, "--model", srv.model, "--workdir", str(ws), "-o", str(out), *extra, task]


def tool_texts(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


def user_texts(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "user"]


# --------------------------------------------------------------------------- pty: confirm mode
def test_confirm_enter_runs_the_command(env, ws, tmp_path, spawn):
    script = [
        {"content": "I write the answer to a file.", "bash": "echo confirmed-$((6*7)) > out.txt; cat out.txt"},
        {"bash": SUBMIT},
    ]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
        t.answer(APPROVE, "")  # Enter: run it
        t.expect("confirmed-42")
        t.answer(APPROVE, "")  # the submit command
        t.answer(FOLLOW_UP, "")  # no follow-up: quit
        assert t.finish() == 0
        requests = srv.requests
    assert (ws / "out.txt").read_text() == "confirmed-42\n"
    assert len(requests) == 2
    assert tool_texts(requests[1]) == ["confirmed-42\n\n(exit_code=0)"]
    screen = t.screen
    for text in ("Step 1", "I write the answer to a file.", "echo confirmed", "exit 0", "tokens:", "Step 2", "submitted after 2 steps"):
        assert text in screen, text
    # The session's records are on disk and say how it ended.
    saved = json.loads((tmp_path / "run" / "trajectory.json").read_text())
    assert saved[-1]["content"].startswith("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "submitted"


def test_typed_text_rejects_and_is_sent_to_the_model(env, ws, tmp_path, spawn):
    (ws / "important").write_text("keep me")
    script = [
        {"content": "Cleaning up.", "bash": "rm -f important"},
        {"content": "Understood, leaving it.", "bash": "ls"},
        {"bash": SUBMIT},
    ]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
        t.answer(APPROVE, "no, keep that file")
        t.answer(APPROVE, "")  # ls
        t.expect("important")
        t.answer(APPROVE, "")
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        requests = srv.requests
    assert (ws / "important").read_text() == "keep me"  # the rejected command never ran
    second = requests[1]
    assert any("no, keep that file" in u for u in user_texts(second)), user_texts(second)
    assert any("rejected" in tt for tt in tool_texts(second))
    assert "rm -f important" in json.dumps(second["messages"][-3:])  # the call the user answered


def test_ctrl_c_at_the_approval_prompt_rejects_with_guidance(env, ws, tmp_path, spawn):
    script = [{"bash": "touch should-not-exist"}, {"bash": SUBMIT}]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
        t.expect(APPROVE)
        t.child.sendintr()
        t.answer(GUIDANCE, "skip that step")
        t.answer(APPROVE, "")
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        requests = srv.requests
    assert not (ws / "should-not-exist").exists()
    assert any("skip that step" in u for u in user_texts(requests[1]))


def test_confirm_without_a_terminal_reads_stdin(env, ws, tmp_path):
    """Piped input instead of a TTY: plain line reads, same semantics."""
    script = [{"bash": "echo piped > p.txt"}, {"bash": "rm p.txt"}, {"bash": SUBMIT}]
    with ScriptedServer(script) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "tmax.cli.main", "run", *run_args(srv, ws, tmp_path / "run", "--env", "local")],
            input="\nkeep it\n\n\n",  # run, reject, run the submit, no follow-up
            env=env,
            cwd=str(ws),
            capture_output=True,
            text=True,
            timeout=120,
        )
        requests = srv.requests
    assert proc.returncode == 0, proc.stderr
    assert (ws / "p.txt").read_text() == "piped\n"
    assert any("keep it" in u for u in user_texts(requests[2]))


def test_ctrl_c_during_a_command_then_guidance(env, ws, tmp_path, spawn):
    script = [
        {"content": "Waiting a long time.", "bash": "export KEPT=alive; sleep 120; echo slept"},
        {"content": "Quicker then.", "bash": "echo after-$KEPT"},
        {"bash": SUBMIT},
    ]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
        t.expect("Waiting a long time.")
        t.expect("Running")
        t.expect("a second Ctrl-C kills it")  # the screen says how to stop a command that ignores Ctrl-C
        time.sleep(1.0)
        started = time.monotonic()
        t.child.sendintr()
        t.answer(GUIDANCE, "do not wait so long")
        # The same shell is still there: the variable exported before the interrupt persists.
        t.expect("after-alive", timeout=60)
        assert time.monotonic() - started < 60  # the 120 s sleep was cut short (generous for a loaded CI machine)
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        requests = srv.requests
    assert "slept" not in "".join(tool_texts(requests[1]))
    assert "(exit_code=130)" in tool_texts(requests[1])[0]
    assert any("do not wait so long" in u for u in user_texts(requests[1]))


def test_ctrl_c_then_quit(env, ws, tmp_path, spawn):
    script = [{"content": "Sleeping.", "bash": "sleep 30"}]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
        t.expect("Running")
        time.sleep(0.5)
        t.child.sendintr()
        t.answer(GUIDANCE, "")  # empty: quit
        assert t.finish() == 130
        assert len(srv.requests) == 1
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "interrupted"
    assert json.loads((tmp_path / "run" / "outcome.json").read_text())["status"] == "interrupted"


def test_unknown_command_then_quit_at_the_approval_prompt(env, ws, tmp_path, spawn):
    with ScriptedServer([{"bash": "touch nope"}]) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
        t.answer(APPROVE, "/bogus")
        t.expect("Unknown command /bogus")
        t.answer(APPROVE, "/q")
        assert t.finish() == 130
        assert len(srv.requests) == 1  # /bogus was not sent to the model as feedback
    assert not (ws / "nope").exists()


def test_ctrl_c_while_waiting_for_the_model(env, ws, tmp_path, spawn):
    script = [{"delay": 30, "bash": "echo never"}, {"content": "With guidance.", "bash": "echo guided"}, {"bash": SUBMIT}]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
        t.expect("Waiting for the model")
        time.sleep(1.0)
        t.child.sendintr()
        t.answer(GUIDANCE, "use echo")
        t.expect("guided", timeout=15)
        t.answer(FOLLOW_UP, "/q")
        assert t.finish() == 0
        requests = srv.requests
    assert "never" not in t.screen
    assert any("use echo" in u for u in user_texts(requests[1]))


def test_yolo_and_confirm_switches_and_follow_up(env, ws, tmp_path, spawn):
    script = [
        {"bash": "export WHO=first; echo one"},
        {"bash": "echo two"},
        {"bash": SUBMIT},
        # follow-up task, in the same shell
        {"bash": "echo follow-$WHO"},
        {"bash": SUBMIT},
    ]
    with ScriptedServer(script) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
        t.answer(APPROVE, "/y")  # switch to yolo and run
        t.expect("Mode: yolo")
        t.expect("one")
        t.expect("two")
        t.answer(FOLLOW_UP, "/c")  # back to confirm, at the follow-up prompt
        t.expect("Mode: confirm")
        t.answer(FOLLOW_UP, "now print who")
        t.answer(APPROVE, "")
        t.expect("follow-first")
        t.answer(APPROVE, "")
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        requests = srv.requests
    # Asked at step 1, not at steps 2-3 (yolo), then again at steps 4-5 (confirm).
    screen = t.screen
    yolo_part = screen[screen.index("Mode: yolo") : screen.index("Mode: confirm")]
    assert "Step 3" in yolo_part and APPROVE not in yolo_part
    assert APPROVE in screen[screen.index("Mode: confirm") :]
    assert len(requests) == 5
    assert user_texts(requests[3])[-1] == "now print who"


@pytest.mark.bwrap
@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap cannot run here")
def test_bwrap_sandbox_in_a_pty(env, ws, tmp_path, spawn):
    script = [
        {"bash": "touch /usr/tmax-must-fail; echo usr-rc=$?; echo jailed > inside.txt; hostname"},
        {"bash": SUBMIT},
    ]
    with ScriptedServer(script) as srv:
        # bwrap defaults to yolo: no approval prompt.
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "bwrap"), env, ws)
        t.expect("usr-rc=1")
        t.expect("tmax-bwrap")
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        assert APPROVE not in t.screen
    assert (ws / "inside.txt").read_text() == "jailed\n"  # the workdir is the writable workspace
    assert not Path("/usr/tmax-must-fail").exists()


# --------------------------------------------------------------------------- headless --json
def run_json(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> tuple[int, list[dict], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tmax.cli.main", "run", "--json", *args],
        env=env,
        cwd=str(cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines()]  # every line is JSON
    return proc.returncode, events, proc.stderr


@pytest.mark.bwrap
@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap cannot run here")
def test_bwrap_shell_is_persistent_again_after_each_restart(env, ws, tmp_path):
    """Commands run on a worker thread; a shell restarted there must outlive that thread
    (bwrap's --die-with-parent follows the forking thread), and keep its state again."""
    restarters = ["exit", "kill -9 $$", "exec bash"]
    script = []
    for i, restart in enumerate(restarters):
        script += [{"bash": restart}, {"bash": f"mkdir -p d{i} && cd d{i} && export A=v{i}"}, {"bash": "echo A=$A; pwd"}]
    script.append({"bash": SUBMIT})
    with ScriptedServer(script) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "bwrap"), env, ws, timeout=120)
    assert rc == 0, stderr
    observations = [e for e in events if e["type"] == "observation"]
    for i, restart in enumerate(restarters):
        restarted, setter, probe = observations[3 * i: 3 * i + 3]
        assert "restarted" in (restarted["note"] or ""), (restart, restarted)
        assert setter["exit_code"] == 0 and setter["note"] is None, (restart, setter)
        # The restarted shell is where the old one was: each directory is made inside the last.
        where = "/".join(f"d{j}" for j in range(i + 1))
        assert probe["observation"] == f"A=v{i}\n{ws}/{where}\n\n(exit_code=0)", (restart, probe)


def test_json_events(env, ws, tmp_path):
    script = [
        {"content": "Listing.", "bash": "echo json-ok"},
        {"content": "I think I am done."},  # no tool call: a format error
        {"bash": SUBMIT},
    ]
    with ScriptedServer(script) as srv:
        code, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "local"), env, ws)
    assert code == 0, stderr
    types = [e["type"] for e in events]
    start, events = events[0], events[1:]
    assert start == {"type": "start", "run_id": "run", "model": srv.model, "base_url": srv.base_url, "sandbox": "local",
                     "workdir": str(ws), "mode": "confirm", "trajectory_dir": str(tmp_path / "run"),
                     "compaction_threshold": 0.8, "instructions": []}
    assert types[1:] == [
        "step", "model", "command", "observation",
        "step", "model", "format_error",
        "step", "model", "command", "observation",
        "done",
    ]
    obs = events[3]
    assert obs["exit_code"] == 0 and obs["observation"] == "json-ok\n\n(exit_code=0)"
    assert events[1]["content"] == "Listing." and events[1]["command"] == "echo json-ok"
    assert events[5]["command"] is None
    assert events[6]["reason"] and events[6]["reason"] in json.dumps(json.loads((tmp_path / "run" / "timing.json").read_text()))
    # Token counts are per turn and cumulative.
    assert events[8]["cumulative"]["prompt_tokens"] == sum(e["usage"]["prompt_tokens"] for e in events if e["type"] == "model")
    done = events[-1]
    assert done["status"] == "submitted" and done["steps"] == 3 and done["exit_code"] == 0
    assert done["trajectory_dir"] == str(tmp_path / "run")


def test_json_sigterm_stops_cleanly(env, ws, tmp_path):
    """SIGTERM (a CI timeout, a supervisor) ends the run as interrupted and removes the shell."""
    marker = f"{os.getpid() % 1000}.{time.monotonic_ns() % 1000}"  # unique argument to find the process
    with ScriptedServer([{"bash": f"sleep 4{marker}"}]) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tmax.cli.main", "run", "--json", *run_args(srv, ws, tmp_path / "run", "--env", "local")],
            env=env, cwd=str(ws), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["type"] == "command":
                time.sleep(0.5)
                proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 130, proc.stderr.read()
    assert events[-1]["type"] == "done" and events[-1]["status"] == "interrupted"
    left = subprocess.run(["pgrep", "-f", f"sleep 4{marker}"], capture_output=True, text=True)
    assert left.stdout == ""


@pytest.mark.parametrize(
    "script, extra, status, code",
    [
        ([{"bash": "echo a"}, {"bash": "echo b"}], ["--max-steps", "2"], "max_steps", 3),
        ([{"error": "auth"}], [], "model_error", 6),
    ],
)
def test_json_exit_status_by_outcome(env, ws, tmp_path, script, extra, status, code):
    with ScriptedServer(script) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "local", *extra), env, ws)
    assert rc == code, stderr
    assert events[-1]["type"] == "done" and events[-1]["status"] == status


@pytest.mark.parametrize(
    "reply",
    [
        {"raw": "<html><body>502 Bad Gateway</body></html>", "content_type": "text/html"},
        {"raw": '{"id": "chatcmpl-1", "choices": [{"message": {"role": "assi'},
        {"raw": ""},
        {"raw": '{"error": {"message": "upstream model overloaded", "code": 503}}'},
    ],
    ids=["html", "truncated-json", "empty-body", "error-object"],
)
def test_json_a_200_that_is_not_a_completion_is_a_model_error(env, ws, tmp_path, reply):
    """Such a reply used to crash the run (AttributeError / JSONDecodeError, exit 1): no `done`
    event, run.json left "running"."""
    with ScriptedServer([{"bash": "echo first"}, reply]) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
        assert len(srv.requests) == 2  # not retried: asking again does not make it a completion
    assert rc == 6, stderr
    done = events[-1]
    assert done["type"] == "done" and done["status"] == "model_error" and "answered 200" in done["error"]
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "model_error" and meta["finished_at"] and meta["steps"] == 1


@pytest.mark.podman
def test_json_sandbox_failure_is_infrastructure(env, ws, tmp_path):
    # A podman image that cannot exist: the sandbox fails to start, which is not the agent's fault.
    with ScriptedServer([{"bash": "true"}]) as srv:
        args = ["--base-url", srv.base_url, "--model", srv.model, "-o", str(tmp_path / "run"), "--env", "podman",
                "--image", "localhost/tmax-no-such-image:none", "go"]
        rc, events, stderr = run_json(args, env, ws, timeout=180)
        assert srv.requests == []
    assert rc == 7, stderr
    assert events[-1]["status"] == "sandbox_error" and "infrastructure" in events[-1]["error"]


@pytest.mark.podman
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
def test_json_in_a_podman_container(env, ws, tmp_path):
    script = [{"bash": "cd /tmp && export IN=container; cat /etc/debian_version >/dev/null && echo debian-ok"}, {"bash": "echo $IN-$(pwd)"}, {"bash": SUBMIT}]
    with ScriptedServer(script) as srv:
        args = ["--base-url", srv.base_url, "--model", srv.model, "-o", str(tmp_path / "run"), "--env", "podman", "go"]
        rc, events, stderr = run_json(args, env, ws, timeout=240)
    assert rc == 0, stderr
    observations = [e["observation"] for e in events if e["type"] == "observation"]
    assert observations[0].startswith("debian-ok")
    assert observations[1].startswith("container-/tmp")  # the container's shell persists between calls


# --------------------------------------------------------------------------- settings precedence
def test_config_file_env_and_flag_precedence(env, ws, tmp_path):
    """Each source really reaches the server: the server demands an API key, so a wrong key
    from a higher-priority source fails with an auth error (exit 6)."""
    script = [{"bash": SUBMIT}] * 3
    with ScriptedServer(script, api_key="sekrit") as srv:
        cfg = tmp_path / "cfg" / "tmax" / "config.toml"
        cfg.parent.mkdir(parents=True)
        cfg.write_text(f'base_url = "{srv.base_url}"\napi_key = "sekrit"\nsandbox = "local"\n')
        base = ["--workdir", str(ws)]

        # File only; the model is discovered from the server's /models.
        rc, events, stderr = run_json([*base, "-o", str(tmp_path / "r1"), "go"], env, ws)
        assert rc == 0, stderr
        assert srv.requests[-1]["model"] == srv.model

        # The environment beats the file.
        env_bad = dict(env, OPENAI_API_KEY="wrong")
        rc, events, _ = run_json([*base, "--model", srv.model, "-o", str(tmp_path / "r2"), "go"], env_bad, ws)
        assert rc == 6 and "authentication" in events[-1]["error"].lower()

        # The flag beats the environment.
        rc, events, stderr = run_json([*base, "--api-key", "sekrit", "-o", str(tmp_path / "r3"), "go"], env_bad, ws)
        assert rc == 0, stderr

        # TMAX_BASE_URL beats OPENAI_BASE_URL and the file's base_url: the other server answers.
        with ScriptedServer([{"bash": SUBMIT}], model="env-model") as other:
            env_url = dict(env, TMAX_BASE_URL=other.base_url, OPENAI_BASE_URL=srv.base_url)
            rc, events, stderr = run_json([*base, "-o", str(tmp_path / "r4"), "go"], env_url, ws)
            assert rc == 0, stderr
            assert [r["model"] for r in other.requests] == ["env-model"]
        assert len(srv.requests) == 2  # r1 and r3; the wrong key of r2 was refused before the script


# --------------------------------------------------------------------------- resume
def test_resume_continues_the_conversation(env, ws, tmp_path):
    first = tmp_path / "first"
    with ScriptedServer([{"bash": "echo saved-state > state.txt"}, {"bash": SUBMIT}]) as srv:
        rc, _, stderr = run_json(run_args(srv, ws, first, "--env", "local"), env, ws)
        assert rc == 0, stderr
        original = srv.requests[-1]["messages"]

    second = tmp_path / "second"
    with ScriptedServer([{"bash": "cat state.txt"}, {"bash": SUBMIT}]) as srv:
        args = run_args(srv, ws, second, "--env", "local", "--resume", str(first), task="now show the state")
        rc, events, stderr = run_json(args, env, ws)
        assert rc == 0, stderr
        sent = srv.requests[0]["messages"]
    # Everything from the first session, then the new request with the fresh-shell note.
    saved = json.loads((first / "trajectory.json").read_text())
    assert sent[: len(saved)] == saved
    assert sent[: len(original)] == original
    assert "now show the state" in sent[-1]["content"] and "new shell" in sent[-1]["content"]
    assert [e for e in events if e["type"] == "observation"][0]["observation"].startswith("saved-state")
    # Step numbers continue, and the new directory holds the whole conversation.
    assert events[1] == {"type": "step", "step": 3}
    assert json.loads((second / "trajectory.json").read_text())[: len(saved)] == saved
    assert json.loads((second / "run.json").read_text())["resumed_from"] == str(first)


def test_resume_bad_path(env, ws, tmp_path):
    rc, events, stderr = run_json(["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--env", "local", "--resume", str(tmp_path / "nope"), "x"], env, ws)
    assert rc == 2 and "cannot resume" in stderr and events[-1]["type"] == "error"


def test_json_progress_events_while_a_long_command_runs(env, ws, tmp_path):
    """A long command used to show nothing until it ended; the model's observation is unchanged."""
    command = "for i in 1 2 3 4; do echo tick$i; sleep 0.7; done"
    with ScriptedServer([{"bash": command}, {"bash": SUBMIT}]) as srv:
        rc, events, stderr = run_json(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
    assert rc == 0, stderr
    progress = [e for e in events if e["type"] == "progress"]
    assert len(progress) >= 2 and all(e["step"] == 1 for e in progress)
    assert progress[0]["output"].startswith("tick1") and progress[-1]["elapsed_s"] >= 1
    assert [e["elapsed_s"] for e in progress] == sorted(e["elapsed_s"] for e in progress)
    assert "".join(e["output"] for e in progress).split() == [f"tick{i}" for i in range(1, len("".join(
        e["output"] for e in progress).split()) + 1)]
    types = [e["type"] for e in events]
    assert types.index("command") < types.index("progress") < types.index("observation")
    observation = next(e for e in events if e["type"] == "observation")["observation"]
    assert observation == "tick1\ntick2\ntick3\ntick4\n\n(exit_code=0)"


def test_the_screen_shows_a_running_command_live(env, ws, tmp_path, spawn):
    command = "echo first-$((1+1)); sleep 2.5; echo done-$((2+3))"  # the output differs from the command
    with ScriptedServer([{"bash": command}, {"bash": SUBMIT}]) as srv:
        t = spawn(run_args(srv, ws, tmp_path / "run", "--env", "local", "--mode", "yolo"), env, ws)
        t.expect("first-2")  # before the command ends: its output so far, live
        t.expect(r"Running… \(Ctrl-C interrupts the command; a second Ctrl-C kills it\) · [12]s")
        assert "done-5" not in t.screen
        t.expect("done-5", timeout=30)
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
