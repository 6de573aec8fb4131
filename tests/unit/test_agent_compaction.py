"""Compaction in the agent loop (`agents.compaction`): the in-process scripted policy
(`tests/scripted_policy.py`), real bash through the `local` sandbox, real records on disk.
The same through `tmax run` in a pty and with --json: tests/integration/test_cli_run_compact.py;
token segments on the nano model served by vLLM: tests/integration/test_run_tokens.py."""

from __future__ import annotations

import json

import pytest
from scripted_policy import ScriptedPolicy

from tmax.agents.compaction import SUMMARY_HEADING, CompactionRecord, SessionContext, rebuild, summary_prompt
from tmax.agents.harnesses import make_harness
from tmax.agents.loop import Agent, AgentHooks
from tmax.agents.prompts import SUBMIT_MARKER
from tmax.agents.recorder import Recorder, load_run, load_segments
from tmax.agents.agent_settings import AgentSettings

SUBMIT = {"content": "THOUGHT: done.", "bash": f"echo {SUBMIT_MARKER}"}
BIG = "python3 -c \"print('{}' * 4000)\""


def small(n: int, total: int | None = None) -> dict:
    turn = {"content": f"THOUGHT: small step {n}.", "bash": f"echo small-{n}"}
    if total is not None:
        turn["usage"] = {"prompt_tokens": total - 20, "completion_tokens": 20, "total_tokens": total}
    return turn


class Seen(AgentHooks):
    def __init__(self) -> None:
        self.started: list[tuple[str, int]] = []
        self.done: list[CompactionRecord] = []

    def on_compaction_start(self, reason, context_tokens):
        self.started.append((reason, context_tokens))

    def on_compaction(self, record):
        self.done.append(record)


def agent_for(policy, box, tmp_path, hooks=None, **cfg):
    return Agent(policy, box, AgentSettings(**cfg), recorder=Recorder(tmp_path / "run"), hooks=hooks,
                 sleep=lambda s: None, harness=make_harness("tmax"))


def contents(messages) -> str:
    return "\n".join(str(m.get("content")) for m in messages)


def test_two_compactions_keep_the_task_and_the_follow_ups_verbatim(open_box, tmp_path):
    script = [{"bash": BIG.format("a")}, {"bash": BIG.format("b")}, small(3), small(4, total=6500),
              {"content": "SUMMARY-ONE: listed files."}, SUBMIT,
              small(6), small(7, total=6600), {"content": "<think>hm</think>SUMMARY-TWO: more."}, SUBMIT,
              SUBMIT]
    policy, hooks = ScriptedPolicy(script, window=8000), Seen()
    agent = agent_for(policy, open_box(), tmp_path, hooks, compaction=True)
    assert agent.run("task ALPHA").status == "submitted"
    assert agent.follow_up("follow-up BETA").status == "submitted"
    assert agent.follow_up("follow-up GAMMA").status == "submitted"
    reqs = policy.requests
    assert [i for i, _ in policy.aside] == [4, 8] and len(reqs) == 11

    # The summary calls: the whole conversation, then the fixed prompt. The server said the
    # context was 6,500 tokens: the summary request would not leave room for the summary, so
    # the two long outputs in it are cut (head and tail kept).
    assert reqs[4][-1] == {"role": "user", "content": summary_prompt(None)}
    assert "a" * 4000 not in contents(reqs[4]) and "a" * 100 in contents(reqs[4])
    assert contents(reqs[4]).count("characters cut here to fit the context window") == 2
    # After the first: the task verbatim, the summary, the last two turns as they were.
    after = reqs[5]
    assert after[0] == reqs[0][0] and after[1]["content"].startswith(reqs[0][1]["content"])
    assert f"{SUMMARY_HEADING}\n\nSUMMARY-ONE: listed files." in after[1]["content"]
    assert after[2:] == reqs[4][-5:-1]  # small 3 and 4 with their outputs
    assert "a" * 4000 not in contents(after) and "b" * 4000 not in contents(after)
    # After the second: the task and the follow-up before it, verbatim, in one carried message.
    carried = reqs[9][1]["content"]
    assert reqs[0][1]["content"] in carried and "follow-up BETA" in carried and "SUMMARY-TWO: more." in carried
    assert "SUMMARY-ONE" not in contents(reqs[9]) and "<think>" not in carried
    assert reqs[10][-1] == {"role": "user", "content": "follow-up GAMMA"}

    first, second = hooks.done
    assert [h[0] for h in hooks.started] == ["auto", "auto"] and first.ok and second.ok
    assert (first.window, first.kept_turns, first.segment, first.pieces) == (8000, 2, 1, 1)
    assert first.tokens_before >= 6500 and [c.where for c in first.clipped] == ["message 3 (tool)", "message 5 (tool)"]
    assert 0 < first.tokens_after < first.tokens_before and first.estimated
    assert second.segment == 2 and second.follow_ups == 1
    # The records: the current context, the closed ones, the session context, the usage.
    run = load_run(tmp_path / "run")
    assert run.messages == [*reqs[10], run.messages[-2], run.messages[-1]]
    segments = load_segments(tmp_path / "run")
    assert [s.segment for s in segments] == [1, 2] and len(segments[0].messages) == len(reqs[4]) - 1
    assert segments[0].messages[:len(reqs[3])] == reqs[3] and "a" * 4000 in contents(segments[0].messages)  # as it was
    assert run.context is not None and [c.summary for c in run.context.compactions] == ["SUMMARY-ONE: listed files.",
                                                                                      "SUMMARY-TWO: more."]
    usage = json.loads((tmp_path / "run" / "usage.json").read_text())
    assert usage["compactions"] == 2 and usage["context_window"] == 8000 and usage["steps"] == 9
    assert usage["completion_tokens"] == agent.usage.completion_tokens  # summary calls counted too


def test_a_failed_summary_keeps_the_session_and_waits_before_trying_again(open_box, tmp_path):
    script = [small(1, total=7200), {"content": ""}, small(2, total=7360), small(3, total=7680),
              {"error": "auth"}, SUBMIT]
    policy, hooks = ScriptedPolicy(script, window=8000), Seen()
    agent = agent_for(policy, open_box(), tmp_path, hooks, compaction=True, compaction_threshold=0.9)
    result = agent.run("task ALPHA")
    # Tried at 7,200 tokens (90 %); after the failure not before 7,200 + 5 % of the window.
    assert result.status == "submitted" and [i for i, _ in policy.aside] == [1, 4]
    empty, fatal = hooks.done
    assert not empty.ok and empty.error == "the model's summary was empty"
    assert not fatal.ok and "the summary call failed" in fatal.error
    # Nothing was replaced: every request holds the whole conversation.
    assert policy.requests[5][:len(policy.requests[3])] == policy.requests[3]
    assert policy.restarts == [] and not (tmp_path / "run" / "segments").exists()


def test_a_summary_too_long_for_the_window_is_cut_not_dropped(open_box, tmp_path):
    script = [small(1, total=7200), {"content": "SUMMARY-HEAD " + "far too long " * 2000 + "SUMMARY-TAIL"}, SUBMIT]
    policy, hooks = ScriptedPolicy(script, window=8000), Seen()
    agent = agent_for(policy, open_box(), tmp_path, hooks, compaction=True, compaction_threshold=0.9)
    assert agent.run("task ALPHA").status == "submitted"
    (record,) = hooks.done
    assert record.ok and record.clipped[-1].where == "the summary" and record.clipped[-1].chars > 26000
    carried = policy.requests[2][1]["content"]
    assert record.summary in carried and len(record.summary) < 26000 < record.clipped[-1].chars
    assert "SUMMARY-HEAD" in carried and "SUMMARY-TAIL" in carried and "characters cut here" in carried


def test_manual_compaction_between_episodes_with_a_focus_and_off_by_default(open_box, tmp_path):
    script = [small(1, total=990), SUBMIT, {"content": "SUMMARY: the tests."}, SUBMIT]
    policy = ScriptedPolicy(script, window=2048)
    agent = agent_for(policy, open_box(), tmp_path)  # compaction off: the Vanillux2 default
    assert AgentSettings().compaction is False
    assert agent.run("task ALPHA").status == "submitted"  # over the threshold, nothing happened
    record = agent.compact("the failing tests")
    assert record.ok and record.reason == "manual" and record.focus == "the failing tests"
    assert policy.requests[2][-1]["content"].endswith("The user asks you to keep this in focus: the failing tests")
    assert policy.aside[0][1] <= 256  # the summary's cap: an eighth of a small window, at least 256
    assert agent.follow_up("go on").status == "submitted"
    assert "SUMMARY: the tests." in policy.requests[3][1]["content"]


def test_rebuild_carries_follow_ups_typed_before_the_kept_turns():
    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "TASK"},
                {"role": "assistant", "content": "1", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c", "content": "o1"},
                {"role": "user", "content": "FOLLOW-1"},
                {"role": "assistant", "content": "2", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c", "content": "o2"},
                {"role": "user", "content": "FOLLOW-2"},
                {"role": "assistant", "content": "3", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c", "content": "o3"}]
    ctx = SessionContext(task=messages[1], follow_up_at=[4, 7])
    rebuilt, new = rebuild(messages, ctx, "SUM", keep=2)
    assert rebuilt[2:] == messages[5:] and new.follow_ups == ["FOLLOW-1"] and new.follow_up_at == [4]
    assert rebuilt[new.follow_up_at[0]]["content"] == "FOLLOW-2"
    again, newer = rebuild(rebuilt, new, "SUM2", keep=0)
    assert len(again) == 2 and newer.follow_ups == ["FOLLOW-1", "FOLLOW-2"] and newer.follow_up_at == []
    text = again[1]["content"]
    assert text.index("TASK") < text.index("FOLLOW-1") < text.index("FOLLOW-2") < text.index("SUM2")


def test_compact_asked_while_the_loop_runs_happens_before_the_next_model_call(open_box):
    from tmax.agents.driver import EpisodeDriver

    class AskAtApproval(AgentHooks):
        driver = None
        queued = []

        def approve(self, step, command):  # `/compact keep X` typed at the approval prompt
            if step == 1:
                self.queued.append(self.driver.compact("keep X"))
            return None

    policy, hooks = ScriptedPolicy([small(1), {"content": "SUMMARY: asked."}, SUBMIT]), AskAtApproval()
    with EpisodeDriver(policy, open_box(), make_harness("tmax"), AgentSettings(), hooks=hooks) as driver:
        hooks.driver = driver
        assert driver.run("task ALPHA").status == "submitted"
        assert driver.context_use.compactions == 1 and driver.context_use.threshold is None  # automatic: off
    assert hooks.queued == [None] and [i for i, _ in policy.aside] == [1]
    assert policy.requests[1][-1]["content"].endswith("keep this in focus: keep X")
    assert "SUMMARY: asked." in policy.requests[2][1]["content"] and "echo small-1" in str(policy.requests[2][2:])


def test_bench_and_learn_take_the_settings_by_name():
    s = AgentSettings.from_settings({"compaction": True, "compaction_threshold": 0.7})
    assert (s.compaction, s.compaction_threshold) == (True, 0.7)
    with pytest.raises(ValueError, match="compaction_threshold"):
        AgentSettings.from_settings({"compaction_threshold": 1.5})


def test_a_conversation_too_long_to_summarise_at_once_is_summarised_in_pieces():
    """40 turns of ~1,000-character outputs in a 4,096-token window: the summary request is
    built to fit with room for the summary. Clipping the outputs is not enough, so the oldest
    turns are summarised in pieces, each piece's request holding the summary so far, the task
    and the follow-up (long, and never clipped) word for word."""
    from tmax.agents.compaction import Compactor
    from tmax.agents.policy import ModelTurn, Usage

    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": '{"command": "make"}'}}
    follow_up = "FOLLOW-UP: also keep the old flag. " * 30
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "TASK ALPHA"}]
    for i in range(40):
        if i == 20:
            messages.append({"role": "user", "content": follow_up})
        messages += [{"role": "assistant", "content": f"turn {i}", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c", "content": f"out-{i} " + "y" * 1000}]
    ctx = SessionContext(task=messages[1], follow_up_at=[messages.index({"role": "user", "content": follow_up})])
    policy = ScriptedPolicy([], window=4096)
    compactor = Compactor(AgentSettings(compaction=True))
    asked: list[tuple[list, int]] = []

    def ask(request, cap):
        asked.append((request, cap))
        return ModelTurn({"role": "assistant", "content": f"PIECE-{len(asked)} done."}, Usage(completion_tokens=9))

    out = compactor.compact(policy, messages, [], ctx, 20000, step=40, reason="auto", focus=None, ask=ask)
    record = out.record
    assert record.ok and record.pieces == len(asked) >= 3 and record.clipped and record.summary_tokens == 9 * len(asked)
    for n, (request, cap) in enumerate(asked, 1):
        assert compactor.counter.count(policy, request, []).tokens + cap <= 4096
        text = contents(request)
        assert "TASK ALPHA" in text and follow_up in text and request[-1] == {"role": "user", "content": summary_prompt(None)}
        assert n == 1 or f"PIECE-{n - 1} done." in text  # the summary so far
    # Every turn was in one piece, oldest first; the last piece's answer is the summary.
    seen = [int(m["content"].split()[1]) for request, _ in asked for m in request if m.get("role") == "assistant"]
    assert seen == list(range(40))
    assert record.summary == f"PIECE-{len(asked)} done." and record.summary in out.messages[1]["content"]


def test_an_overflow_from_the_server_compacts_and_retries_the_turn_once(open_box, tmp_path):
    """The server refuses a request as too long (its count is not ours): the session is
    compacted and the same turn tried again; a second refusal of that turn ends it."""
    script = [small(1), {"error": "context_length"}, {"content": "SUMMARY: one step."}, SUBMIT,
              small(2), {"error": "context_length"}, {"content": "SUMMARY: two."}, {"error": "context_length"}]
    policy, hooks = ScriptedPolicy(script, window=8000), Seen()
    agent = agent_for(policy, open_box(), tmp_path, hooks, compaction=True)
    assert agent.run("task ALPHA").status == "submitted"
    (record,) = hooks.done
    assert record.ok and record.reason == "overflow" and [i for i, _ in policy.aside] == [2]
    assert "SUMMARY: one step." in policy.requests[3][1]["content"]  # the refused turn, tried again
    result = agent.follow_up("follow-up BETA")
    assert result.status == "context_overflow" and "context window exceeded" in result.error
    assert [r.reason for r in hooks.done] == ["overflow", "overflow"] and len(policy.requests) == 8


def test_an_overflow_right_after_a_compaction_rebuilds_it_from_the_same_summary(open_box, tmp_path):
    """The server counts the freshly compacted context higher than we did and refuses it:
    nothing new to summarise, so the same summary is fitted again (by the server's count where
    its error gives one: cut where it no longer fits) and the turn
    tried again; no second summary call."""
    script = [small(1, total=7200), {"content": "SUMMARY-ONE " + "detail " * 700},
              {"error": "context_length"}, SUBMIT]
    policy, hooks = ScriptedPolicy(script, window=8000), Seen()
    agent = agent_for(policy, open_box(), tmp_path, hooks, compaction=True, compaction_threshold=0.5)
    assert agent.run("task ALPHA").status == "submitted"
    auto, overflow = hooks.done
    assert auto.ok and auto.kept_turns == 0 and overflow.ok and overflow.reason == "overflow"
    assert [i for i, _ in policy.aside] == [1] and overflow.pieces == 0 and overflow.segment == 2
    assert overflow.summary.startswith("SUMMARY-ONE") and overflow.summary in policy.requests[3][1]["content"]
