"""The agent loop's rules (`agents.loop.Agent`), unit-fast: the in-process scripted policy
(`tests/scripted_policy.py`) and real bash through the `local` sandbox. The same loop
against a real HTTP model server, every harness and Ctrl-C: tests/integration/test_agent_loop.py."""

from __future__ import annotations

import pytest
from scripted_policy import ScriptedPolicy

from tmax.agents.harnesses import make_harness
from tmax.agents.loop import Agent, AgentHooks
from tmax.agents.agent_settings import AgentSettings
from tmax.agents.prompts import REJECTED_TOOL_TEXT, SUBMIT_MARKER
from tmax.agents.recorder import Recorder, load_run
from tmax.common.records import AgentStatus, EpisodeOutcome

SUBMIT = {"content": "THOUGHT: done.", "bash": f"echo {SUBMIT_MARKER}"}


def agent_for(policy, box, tmp_path=None, hooks=None, **cfg):
    recorder = Recorder(tmp_path / "run") if tmp_path is not None else None
    sleeps: list[float] = []
    agent = Agent(policy, box, AgentSettings(**cfg), recorder=recorder, hooks=hooks, sleep=sleeps.append,
                  harness=make_harness("tmax"))
    return agent, sleeps


def test_context_budget_guard(open_box):
    big = {"bash": "echo hi", "usage": {"prompt_tokens": 900, "completion_tokens": 200, "total_tokens": 1100}}
    policy = ScriptedPolicy([big, SUBMIT])
    agent, _ = agent_for(policy, open_box(), context_budget=1000)
    result = agent.run("task")
    assert len(policy.requests) == 1
    assert result.status == "context_overflow" and result.steps == 1


def test_max_steps(open_box):
    policy = ScriptedPolicy([{"bash": "echo step"}] * 4)
    agent, _ = agent_for(policy, open_box(), max_steps=3)
    result = agent.run("task")
    assert len(policy.requests) == 3
    assert result.status == "max_steps" and result.steps == 3
    assert result.usage.total_tokens > 0


def test_format_error_limit_counts_consecutive_errors_and_steps(open_box):
    plain = {"content": "no call"}
    policy = ScriptedPolicy([plain, {"bash": "echo ok"}, plain, plain, SUBMIT])
    agent, _ = agent_for(policy, open_box(), max_format_errors=2)
    result = agent.run("task")
    assert len(policy.requests) == 4
    assert result.status == "format_errors" and result.steps == 4


def test_format_errors_consume_steps(open_box):
    policy = ScriptedPolicy([{"content": "no call"}] * 3 + [SUBMIT])
    agent, _ = agent_for(policy, open_box(), max_steps=3)
    result = agent.run("task")
    assert result.status == "max_steps" and result.steps == 3


def test_marker_in_output_stops(open_box, tmp_path):
    (tmp_path / "notes.txt").write_text(f"the word is {SUBMIT_MARKER}\n")
    policy = ScriptedPolicy([{"bash": "cat notes.txt"}, {"bash": "echo never"}])
    agent, _ = agent_for(policy, open_box())
    result = agent.run("task")
    assert len(policy.requests) == 1
    assert result.status == "submitted" and result.steps == 1


def test_rejected_command_is_not_run_and_feedback_goes_back(open_box, tmp_path):
    class Reject(AgentHooks):
        def approve(self, step, command):
            return "do not create files" if "touch" in command else None

    policy = ScriptedPolicy([{"bash": "touch created"}, {"bash": "ls"}, SUBMIT])
    agent, _ = agent_for(policy, open_box(), hooks=Reject())
    result = agent.run("task")
    reqs = policy.requests
    assert result.status == "submitted" and not (tmp_path / "created").exists()
    tool, user = reqs[1][-2:]
    assert tool["role"] == "tool" and tool["content"] == REJECTED_TOOL_TEXT
    assert user == {"role": "user", "content": "The user did not run your command and says: do not create files"}
    assert reqs[2][-1]["content"] == "(no output)\n\n(exit_code=0)"


def test_sandbox_failure_is_an_infrastructure_error(open_box):
    box = open_box()
    box.close()
    policy = ScriptedPolicy([{"bash": "echo hi"}])
    agent, _ = agent_for(policy, box)
    result = agent.run("task")
    assert result.status == "sandbox_error" and result.error


def test_resume_from_records(open_box, tmp_path):
    policy = ScriptedPolicy([{"bash": "echo first"}, SUBMIT])
    agent, _ = agent_for(policy, open_box(), tmp_path)
    assert agent.run("task").status == "submitted"
    saved = load_run(tmp_path / "run")
    assert saved.outcome == EpisodeOutcome(status=AgentStatus.SUBMITTED, steps=2, error=None)
    policy = ScriptedPolicy([{"bash": "echo again"}, SUBMIT])
    agent2, _ = agent_for(policy, open_box(), tmp_path)
    agent2.load(saved)
    result = agent2.follow_up("once more")
    reqs = policy.requests
    assert reqs[0] == saved.messages + [{"role": "user", "content": "once more"}]
    assert result.status == "submitted" and result.steps == 4
    assert load_run(tmp_path / "run").messages == result.messages


def test_empty_task_is_rejected(open_box):
    policy = ScriptedPolicy([])
    agent, _ = agent_for(policy, open_box())
    with pytest.raises(ValueError, match="empty"):
        agent.run("   ")


def test_quit_at_the_approval_prompt_keeps_a_valid_history(open_box, tmp_path):
    class QuitAtPrompt(AgentHooks):
        def approve(self, step, command):
            raise KeyboardInterrupt

    policy = ScriptedPolicy([{"bash": "touch never"}])
    agent, _ = agent_for(policy, open_box(), hooks=QuitAtPrompt())
    result = agent.run("task")
    assert result.status == "interrupted" and not (tmp_path / "never").exists()
    # The unanswered call is answered, so the saved conversation can be resumed as is.
    assistant, tool = result.messages[-2:]
    assert assistant["role"] == "assistant" and assistant["tool_calls"]
    assert tool == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": REJECTED_TOOL_TEXT}


def test_a_stopped_conversation_continues_in_another_agent_with_its_count_of_format_errors(open_box):
    """`continue_from` + `resume` (a branch of a forked episode): the new agent answers the
    messages as they stood, its steps go on from the old count, and format errors in a row
    before the stop still count toward the limit."""
    plain = {"content": "no call"}

    class StopAfter2(AgentHooks):
        def on_format_error(self, step, feedback, reason=None):
            if step == 2:
                trunk.stop.set()

    trunk, _ = agent_for(ScriptedPolicy([{"bash": "echo one"}, plain]), open_box(), hooks=StopAfter2(),
                         max_format_errors=2)
    assert trunk.run("task").status == "stopped" and trunk.steps == 2
    policy = ScriptedPolicy([plain, SUBMIT])
    branch, _ = agent_for(policy, open_box(), max_format_errors=2)
    branch.continue_from(trunk)
    result = branch.resume()
    # The branch's first turn is the second format error in a row: the limit ends it.
    assert result.status == "format_errors" and result.steps == 3 and len(policy.requests) == 1
    assert policy.requests[0] == trunk.messages
    assert len(branch.timing) == 3 and len(trunk.timing) == 2  # copied, not shared
