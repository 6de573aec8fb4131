"""The agent loop end to end: a real HTTP model server (scripted turns), the real openai
client, a real persistent shell in a real sandbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
from scripted_server import ScriptedServer

from tmax.agents.chat_policy import ChatPolicy
from tmax.agents.harnesses import make_harness
from tmax.agents.loop import Agent, AgentHooks
from tmax.agents.prompts import FORMAT_ERROR_TEXT, SUBMIT_MARKER, SYSTEM_TEMPLATE
from tmax.agents.agent_settings import AgentSettings
from tmax.agents.recorder import load_run, Recorder

SUBMIT = {"content": "THOUGHT: done.", "bash": f"echo {SUBMIT_MARKER}"}


class Sleeps:
    def __init__(self):
        self.calls = []

    def __call__(self, s):
        self.calls.append(s)


def agent_for(srv, box, tmp_path=None, hooks=None, timeout=30.0, harness="tmax", **cfg):
    sleeps = Sleeps()
    policy = ChatPolicy(model=srv.model, base_url=srv.base_url, timeout=timeout)
    recorder = Recorder(tmp_path / "run") if tmp_path is not None else None
    agent = Agent(policy, box, AgentSettings(**cfg), recorder=recorder, hooks=hooks, sleep=sleeps,
                  harness=make_harness(harness))
    return agent, sleeps


RAW_XML = (
    "THOUGHT: check state.\n<tool_call>\n<function=bash>\n<parameter=command>\n"
    'echo "$GREETING in $(basename "$PWD")"\n</parameter>\n</function>\n</tool_call>'
)


@pytest.mark.parametrize(
    "kind", ["local", pytest.param("bwrap", marks=pytest.mark.bwrap), pytest.param("podman", marks=pytest.mark.podman)]
)
def test_episode_good_bad_and_raw_calls_then_follow_up(kind, open_box, tmp_path):
    script = [
        {"content": "THOUGHT: set up.", "bash": 'D=$(mktemp -d) && cd "$D" && export GREETING=hello && echo made'},
        {"content": "I would rather just talk."},  # no call: user feedback
        {"content": "THOUGHT: python!", "tool_calls": [{"name": "python", "arguments": {"code": "1"}}]},  # wrong tool
        {"content": "", "tool_calls": [{"name": "bash", "arguments": "{not json"}]},  # broken arguments
        {"content": RAW_XML},  # raw qwen3_xml text, no native call
        {"bash": "seq 1 3000"},  # long output
        {"bash": "false"},
        SUBMIT,
        {"bash": 'echo "$GREETING"; basename "$PWD"'},  # follow-up: same shell
        {"bash": "printf '%s_%s\\n' COMPLETE_TASK_AND_SUBMIT FINAL_OUTPUT"},  # marker only in output
    ]
    box = open_box(kind)
    with ScriptedServer(script, process=True) as srv:
        agent, sleeps = agent_for(srv, box, tmp_path)
        result = agent.run("  Make a directory and greet.  ")
        assert result.status == "submitted", result.error
        assert result.steps == 8
        first = agent.follow_up("Now print the greeting again.")
        reqs = srv.requests

    assert first.status == "submitted" and first.steps == 10
    assert sleeps.calls == []
    assert len(reqs) == 10
    msgs0 = reqs[0]["messages"]
    assert [m["role"] for m in msgs0] == ["system", "user"]
    assert msgs0[0]["content"] == SYSTEM_TEMPLATE
    assert "Make a directory and greet.\n\n" in msgs0[1]["content"]

    def last(i):
        return reqs[i]["messages"][-1]

    assert last(1)["role"] == "tool" and last(1)["content"] == "made\n\n(exit_code=0)"
    assert last(1)["tool_call_id"] == reqs[1]["messages"][-2]["tool_calls"][0]["id"]
    # plain text -> user feedback
    assert last(2)["role"] == "user" and last(2)["content"].startswith(f"Format error: {FORMAT_ERROR_TEXT}")
    # wrong tool name -> tool feedback answering that call
    assert last(3)["role"] == "tool" and last(3)["content"].startswith("Format error:")
    assert last(3)["tool_call_id"] == reqs[3]["messages"][-2]["tool_calls"][0]["id"]
    # broken arguments -> the call is dropped, user feedback
    assert last(4)["role"] == "user" and "tool_calls" not in reqs[4]["messages"][-2]
    # raw text call: normalised to a native call, state persisted from step 1
    assert last(5)["role"] == "tool"
    assert last(5)["content"].startswith("hello in tmp.") and last(5)["content"].endswith("\n\n(exit_code=0)")
    assert reqs[5]["messages"][-2]["content"] == "THOUGHT: check state."
    long_obs = last(6)["content"]
    assert "---- HEAD (5000 chars) ----\n1\n2\n3\n" in long_obs and long_obs.endswith("2999\n3000\n\n(exit_code=0)")
    assert last(7)["content"] == "(no output)\n\n(exit_code=1)"
    assert last(8) == {"role": "user", "content": "Now print the greeting again."}
    assert last(9)["content"].startswith("hello\ntmp.") and last(9)["content"].endswith("(exit_code=0)")

    # Records: written as the run went, equal to what was sent.
    saved = load_run(tmp_path / "run")
    assert saved.messages == agent.messages
    assert saved.messages[: len(reqs[9]["messages"])] == reqs[9]["messages"]
    assert saved.messages[-1]["content"] == f"{SUBMIT_MARKER}\n\n(exit_code=0)"
    timing = json.loads((tmp_path / "run" / "timing.json").read_text())
    assert [t["step"] for t in timing] == list(range(1, 11))
    assert [bool(t.get("format_error")) for t in timing] == [False, True, True, True] + [False] * 6
    assert timing[6]["return_code"] == 1 and timing[6]["cmd"] == "false"
    usage = json.loads((tmp_path / "run" / "usage.json").read_text())
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens", "cost_usd", "max_steps",
                          "steps", "context_tokens", "context_window", "compactions"}
    assert usage["max_steps"] == 64 and usage["prompt_tokens"] > 0 and usage["steps"] == 10
    assert usage["context_window"] == 65536 and usage["compactions"] == 0
    assert json.loads((tmp_path / "run" / "outcome.json").read_text())["status"] == "submitted"
    assert not (tmp_path / "run" / "tokens.json").exists()


def test_retries_with_backoff_then_success(open_box):
    with ScriptedServer([{"error": "server"}, {"status": 503}, {"status": 429}, SUBMIT]) as srv:
        agent, sleeps = agent_for(srv, open_box())
        result = agent.run("task")
        assert len(srv.requests) == 4
    assert result.status == "submitted" and result.steps == 1
    assert sleeps.calls == [2, 4, 8]


def test_gives_up_after_five_attempts(open_box):
    with ScriptedServer([{"error": "server"}] * 6) as srv:
        agent, sleeps = agent_for(srv, open_box())
        result = agent.run("task")
        assert len(srv.requests) == 5
    assert result.status == "model_error" and "5 attempts" in result.error
    assert sleeps.calls == [2, 4, 8, 16]


def test_timeout_is_retried(open_box, tmp_path):
    marker = tmp_path / "late-ran"
    with ScriptedServer([{"delay": 3, "bash": f"touch {marker}"}, SUBMIT]) as srv:
        agent, sleeps = agent_for(srv, open_box(), timeout=0.5)
        result = agent.run("task")
    assert result.status == "submitted" and sleeps.calls == [2]
    assert not marker.exists()


@pytest.mark.parametrize("error", ["auth", "not_found", "bad_request"])
def test_fatal_errors_are_not_retried(error, open_box):
    with ScriptedServer([{"error": error}, SUBMIT]) as srv:
        agent, sleeps = agent_for(srv, open_box())
        result = agent.run("task")
        assert len(srv.requests) == 1
    assert result.status == "model_error" and sleeps.calls == []


def test_context_overflow_ends_cleanly(open_box):
    with ScriptedServer([{"bash": "echo hi"}, {"error": "context_length"}]) as srv:
        agent, sleeps = agent_for(srv, open_box())
        result = agent.run("task")
    assert result.status == "context_overflow" and result.steps == 1 and sleeps.calls == []
    assert result.messages[-1]["content"] == "hi\n\n(exit_code=0)"


class Interrupter(AgentHooks):
    """Sends SIGINT to the main thread while a command runs (or shortly after a model call
    starts), like a person pressing Ctrl-C."""

    def __init__(self, on_command=None, on_step=None, guidance=("stop that",), presses=1):
        self.on_command, self.on_step, self.presses = on_command, on_step, presses
        self.guidance = list(guidance)
        self.asked = 0
        self.fired = False

    def _later(self, running: str | None = None):
        # Once only: a real SIGINT to the main thread (blocking reads are interrupted too),
        # once the `running` command is a process (the local sandbox's, so pgrep sees it):
        # a fixed delay can land before the command starts on a loaded machine.
        if self.fired:
            return
        self.fired = True
        main = threading.main_thread().ident

        def press():
            deadline = time.monotonic() + 15
            while running and time.monotonic() < deadline and subprocess.run(
                    ["pgrep", "-f", f"^{running}$"], capture_output=True).returncode != 0:
                time.sleep(0.05)
            for _ in range(self.presses):  # a second press: the first one was ignored
                time.sleep(0.3 if _ == 0 else 1.0)
                signal.pthread_kill(main, signal.SIGINT)

        threading.Thread(target=press, daemon=True).start()

    def on_step_start(self, step):
        if step == self.on_step:
            self._later()

    def on_model_turn(self, step, turn, command):
        if command and self.on_command and self.on_command in command:
            self._later(self.on_command)

    def on_interrupt(self):
        self.asked += 1
        return self.guidance.pop(0) if self.guidance else None


def test_ctrl_c_interrupts_the_command_and_keeps_the_shell(open_box):
    hooks = Interrupter(on_command="sleep 30")
    script = [{"bash": "export KEEP=1 && sleep 30"}, {"bash": 'echo "KEEP=$KEEP"'}, SUBMIT]
    with ScriptedServer(script) as srv:
        agent, _ = agent_for(srv, open_box(), hooks=hooks)
        t0 = time.monotonic()
        result = agent.run("task")
        reqs = srv.requests
    assert time.monotonic() - t0 < 20
    assert result.status == "submitted" and hooks.asked == 1
    tool, user = reqs[1]["messages"][-2:]
    assert tool["role"] == "tool" and tool["content"].endswith("(exit_code=130)")
    assert user == {"role": "user", "content": "The user interrupted you and says: stop that"}
    assert reqs[2]["messages"][-1]["content"] == "KEEP=1\n\n(exit_code=0)"


def _turn(harness: str, command: str, wait: float = 40) -> dict:
    """A scripted turn that runs `command` under `harness` (terminus-2 then waits `wait` s)."""
    if harness == "mini-swe":
        return {"content": f"THOUGHT: run it.\n\n```bash\n{command}\n```"}
    keys = [{"keystrokes": command + "\n", "duration": wait}]
    return {"content": json.dumps({"analysis": "a", "plan": "p", "commands": keys, "task_complete": False})}


def _submit(harness: str) -> list[dict]:
    if harness == "mini-swe":
        return [_turn(harness, f"echo {SUBMIT_MARKER}")]
    done = {"content": json.dumps({"analysis": "a", "plan": "p", "commands": [], "task_complete": True})}
    return [done, done]  # the second one confirms


@pytest.mark.parametrize("presses", [1, 2])
@pytest.mark.parametrize("harness", ["mini-swe", "terminus-2"])
def test_ctrl_c_reaches_the_command_under_every_harness(open_box, harness, presses):
    """Ctrl-C stops a mini-swe command (a fresh process) and one typed into terminus-2's
    terminal; a second Ctrl-C kills a command that ignores the first. Either way the
    next command runs."""
    sleeper = f"sleep 3{presses}.{os.getpid() % 1000:03d}"  # this run's own process
    command = sleeper if presses == 1 else f"bash -c \"trap '' INT; {sleeper}\""
    hooks = Interrupter(on_command=sleeper, presses=presses)
    script = [_turn(harness, command), _turn(harness, "echo after", wait=1), *_submit(harness)]
    with ScriptedServer(script) as srv:
        agent, _ = agent_for(srv, open_box(), hooks=hooks, harness=harness)
        t0 = time.monotonic()
        result = agent.run("task")
        reqs = srv.requests
    assert time.monotonic() - t0 < 20 and result.status == "submitted" and hooks.asked == 1
    gone = time.monotonic() + 5  # nothing left running (a killed process takes a moment to go)
    while subprocess.run(["pgrep", "-f", f"^{sleeper}$"]).returncode == 0 and time.monotonic() < gone:
        time.sleep(0.1)
    assert subprocess.run(["pgrep", "-f", f"^{sleeper}$"]).returncode == 1
    observed, guidance = (m["content"] for m in reqs[1]["messages"][-2:])
    assert guidance == "The user interrupted you and says: stop that"
    if harness == "mini-swe":
        assert observed.startswith(f"<returncode>{130 if presses == 1 else 137}</returncode>")
    assert "after" in reqs[2]["messages"][-1]["content"]


def test_ctrl_c_without_guidance_stops(open_box):
    hooks = Interrupter(on_command="sleep 30", guidance=())
    with ScriptedServer([{"bash": "sleep 30"}, SUBMIT]) as srv:
        agent, _ = agent_for(srv, open_box(), hooks=hooks)
        result = agent.run("task")
    assert result.status == "interrupted" and result.steps == 1
    # The shell survived the interrupt and still runs commands.
    assert agent.sandbox.run("echo alive", timeout=10).output.strip() == "alive"


def test_ctrl_c_during_the_model_call(open_box):
    hooks = Interrupter(on_step=1, guidance=("hurry up",))
    with ScriptedServer([{"delay": 4, "bash": "echo slow"}, SUBMIT]) as srv:
        agent, sleeps = agent_for(srv, open_box(), hooks=hooks)
        result = agent.run("task")
        reqs = srv.requests
    assert result.status == "submitted" and result.steps == 1 and sleeps.calls == []
    assert reqs[1]["messages"][-1] == {"role": "user", "content": "The user interrupted you and says: hurry up"}
    assert not any(m.get("role") == "tool" and "slow" in m["content"] for m in result.messages)

