"""The harnesses' parsers and observation formatters (pure functions, no sandbox)."""

from __future__ import annotations

import json

import pytest

from tmax.agents.harnesses import HARNESSES, make_harness
from tmax.agents.mini_swe import MiniSweHarness, find_actions
from tmax.agents.observation import ObservationLimits
from tmax.agents.terminus import CONFIRM_TEXT, KeystrokeAction, TerminusHarness, parse_keystrokes
from tmax.sandbox.base import CommandResult

MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def test_registry_names_and_errors():
    assert [make_harness(n).name for n in HARNESSES] == list(HARNESSES)
    assert make_harness("tmax").tools and not make_harness("mini-swe").tools and not make_harness("terminus-2").tools
    with pytest.raises(ValueError, match="unknown harness"):
        make_harness("openhands")


def test_mini_swe_needs_exactly_one_bash_block():
    h = MiniSweHarness()
    assert h.parse({"content": "THOUGHT: x\n\n```bash\nls -la\n```"}).command == "ls -la"
    two = h.parse({"content": "```bash\nls\n```\nand\n```bash\npwd\n```"})
    assert two.is_format_error and "found 2" in h.format_error(two)
    assert h.parse({"content": "no block"}).is_format_error
    # A block the model only thought about does not count.
    assert find_actions("<think>```bash\nrm -rf /\n```</think>\n```bash\necho ok\n```") == ["echo ok"]


def test_mini_swe_observation_submit_and_truncation():
    h = MiniSweHarness()
    act = h.parse({"content": "```bash\necho hi\n```"})
    text, done = h.observe(act, CommandResult("hi\n", 0), ObservationLimits())
    assert text == "<returncode>0</returncode>\n<output>\nhi\n</output>" and not done
    assert h.observe(act, CommandResult(f"{MARKER}\n", 0), ObservationLimits())[1]
    assert not h.observe(act, CommandResult(f"other\n{MARKER}\n", 0), ObservationLimits())[1]
    long, _ = h.observe(act, CommandResult("x" * 50, 1), ObservationLimits(20, 10, 10))
    assert "<elided_chars>\n30 characters elided" in long and "<returncode>1</returncode>" in long
    timed, _ = h.observe(act, CommandResult("partial", 124, timed_out=True), ObservationLimits())
    assert "timed out" in timed and "partial" in timed


def test_terminus_parses_keystrokes_and_reports_errors():
    ok = parse_keystrokes('Sure.\n{"analysis": "a", "plan": "p", "commands": '
                          '[{"keystrokes": "ls\\n", "duration": 120}, {"keystrokes": "C-c"}], "task_complete": false}')
    assert isinstance(ok, KeystrokeAction) and not ok.is_format_error
    assert ok.commands == (("ls\n", 60.0), ("C-c", 1.0))
    assert "missing required fields: plan" in parse_keystrokes('{"analysis": "a", "commands": []}').error
    assert "no JSON object" in parse_keystrokes("just text").error
    assert "keystrokes" in parse_keystrokes('{"analysis": "", "plan": "", "commands": [{"keys": "ls"}]}').error
    bad = parse_keystrokes('{"analysis": "a", "plan": "p", "commands": [],}')
    assert "invalid JSON" in TerminusHarness().format_error(bad)


def test_terminus_needs_two_task_complete_in_a_row():
    h = TerminusHarness()
    done = parse_keystrokes(json.dumps({"analysis": "", "plan": "", "commands": [], "task_complete": True}))
    more = parse_keystrokes(json.dumps({"analysis": "", "plan": "", "commands": [], "task_complete": False}))
    screen = CommandResult("New Terminal Output:\n$", 0)
    first, finished = h.observe(done, screen, ObservationLimits())
    assert not finished and CONFIRM_TEXT in first
    assert h.observe(more, screen, ObservationLimits()) == ("New Terminal Output:\n$", False)  # resets
    assert not h.observe(done, screen, ObservationLimits())[1]
    assert h.observe(done, screen, ObservationLimits())[1]


@pytest.mark.parametrize("name", HARNESSES)
def test_demo_turns_parse_back_to_the_step(name):
    """A scripted step written as the harness's model would write it parses back to that
    step's action; the submit step ends the episode (terminus-2: after its confirmation)."""
    h = make_harness(name)
    h.initial_messages("task")
    command = 'printf "%s\\n" "a b" | sort > out.txt'
    [turn] = h.demo_turns("THOUGHT: sort it.", command)
    act = h.parse(turn)
    assert not act.is_format_error and not act.submit
    if name == "terminus-2":
        assert act.commands == ((command + "\n", 1.0),) and not act.task_complete
    else:
        assert act.command == command
    submit = h.demo_turns("THOUGHT: done.", f"echo {MARKER}")
    assert len(submit) == (2 if name == "terminus-2" else 1)
    output = CommandResult(f"{MARKER}\n", 0)
    finished = [h.observe(a, output, ObservationLimits())[1] for a in map(h.parse, submit)]
    assert finished == [False] * (len(submit) - 1) + [True]
