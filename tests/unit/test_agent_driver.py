"""The episode driver (`agents.driver`): a deadline or a cancel stops the running command and
the loop, a model call that hangs past the deadline is abandoned after the grace, the time
split adds up. Real bash through the `local` sandbox; the model is the in-process scripted
policy."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from scripted_policy import ScriptedPolicy

from tmax.agents import driver as driver_mod
from tmax.agents.driver import EpisodeDriver
from tmax.agents.harnesses import make_harness
from tmax.agents.agent_settings import AgentSettings
from tmax.agents.prompts import SUBMIT_MARKER
from tmax.agents.recorder import Recorder

SUBMIT = {"content": "THOUGHT: done.", "bash": f"echo {SUBMIT_MARKER}"}


@pytest.fixture
def box(open_box):
    return open_box()


def _alive(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0


def _gone(pattern: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pattern) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pattern)


def _sleeper(tag: str) -> str:
    """A sleep this test alone runs, so pgrep finds it and nothing else."""
    return f"sleep 3{time.monotonic_ns() % 100000}.{tag}"


def _driver(policy, box, tmp_path=None, **kw) -> EpisodeDriver:
    recorder = Recorder(tmp_path / "run") if tmp_path is not None else None
    return EpisodeDriver(policy, box, make_harness("tmax"), AgentSettings(), recorder=recorder, **kw)


def test_the_deadline_interrupts_the_command_and_stops_the_loop(box, tmp_path):
    sleeper = _sleeper("1")
    policy = ScriptedPolicy([{"bash": f"echo started && {sleeper}"}, {"bash": "echo never"}])
    with _driver(policy, box, tmp_path, timeout=1.0) as driver:
        result = driver.run("task")
    assert result.status == "stopped" and result.timed_out and not result.cancelled
    assert len(policy.requests) == 1 and result.steps == 1  # the loop asked for nothing more
    assert result.messages[-1]["content"].startswith("started") and "(exit_code=130)" in result.messages[-1]["content"]
    assert _gone(sleeper)
    assert json.loads((tmp_path / "run" / "outcome.json").read_text())["status"] == "stopped"
    assert box.run("echo alive", timeout=10).output.strip() == "alive"  # the shell survived


def test_a_command_that_ignores_ctrl_c_is_killed_after_the_stop(box, monkeypatch):
    monkeypatch.setattr(driver_mod, "FORCE_EVERY_S", 0.5)
    sleeper = _sleeper("2")
    policy = ScriptedPolicy([{"bash": f"bash -c \"trap '' INT; {sleeper}\""}, {"bash": "echo never"}])
    with _driver(policy, box, timeout=1.0) as driver:
        result = driver.run("task")
    assert result.status == "stopped" and result.timed_out and len(policy.requests) == 1
    assert "(exit_code=137)" in result.messages[-1]["content"]
    assert _gone(sleeper)


def test_cancel_stops_the_loop(box):
    sleeper = _sleeper("3")
    cancel = threading.Event()

    def press() -> None:
        deadline = time.monotonic() + 15
        while not _alive(sleeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        cancel.set()

    policy = ScriptedPolicy([{"bash": sleeper}, {"bash": "echo never"}])
    threading.Thread(target=press, daemon=True).start()
    with _driver(policy, box, cancel=cancel) as driver:  # no deadline: the loop runs on this thread
        result = driver.run("task")
    assert result.status == "stopped" and result.cancelled and not result.timed_out
    assert len(policy.requests) == 1 and _gone(sleeper)


def test_an_answer_after_the_deadline_runs_nothing(box, tmp_path):
    marker = tmp_path / "late-ran"
    policy = ScriptedPolicy([{"delay": 1.5, "bash": f"touch {marker}"}])
    with _driver(policy, box, timeout=0.3, grace_s=30) as driver:
        result = driver.run("task")
    assert result.status == "stopped" and result.timed_out and result.steps == 1
    assert not marker.exists()
    assert result.messages[-1]["role"] == "user"  # the unanswered call is not in the history


def test_a_hung_model_call_is_abandoned_after_the_grace(box, monkeypatch):
    harness = make_harness("tmax")
    closed = []
    monkeypatch.setattr(harness, "close", lambda: closed.append(True))  # the abandoned loop may still use it
    policy = ScriptedPolicy([{"delay": 60, "bash": "echo never"}])
    driver = EpisodeDriver(policy, box, harness, AgentSettings(), timeout=0.2, grace_s=0.3)
    try:
        result = driver.run("task")
        assert result.status == "abandoned" and result.abandoned and result.timed_out
        assert "did not return" in result.error and result.steps == 0
        driver.close()
        assert closed == []
        with pytest.raises(RuntimeError, match="abandoned"):
            driver.run("again")
    finally:
        policy.close()  # the hung call returns; the loop sees the stop and ends


def test_the_time_split_adds_up(box, tmp_path):
    policy = ScriptedPolicy([{"delay": 0.2, "bash": "sleep 0.3"}, {"delay": 0.1, **SUBMIT}])
    with _driver(policy, box, tmp_path) as driver:
        result = driver.run("task")
    assert result.status == "submitted" and not result.stopped
    timing = json.loads((tmp_path / "run" / "timing.json").read_text())
    assert result.llm_s == round(sum(t["llm_s"] for t in timing), 3) and result.llm_s >= 0.3
    assert result.exec_s == round(sum(t["bash_s"] for t in timing), 3) and result.exec_s >= 0.3
    assert result.agent_s >= result.llm_s + result.exec_s


def test_a_follow_up_counts_its_own_time(box, tmp_path):
    policy = ScriptedPolicy([SUBMIT, {"bash": "sleep 0.2"}, SUBMIT])
    with _driver(policy, box, tmp_path) as driver:
        first = driver.run("task")
        second = driver.follow_up("once more")
    assert first.status == second.status == "submitted" and second.steps == 3
    timing = json.loads((tmp_path / "run" / "timing.json").read_text())
    assert first.exec_s == round(timing[0]["bash_s"], 3)
    assert second.exec_s == round(sum(t["bash_s"] for t in timing[1:]), 3) and second.exec_s >= 0.2
