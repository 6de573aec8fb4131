"""The agentic measures (`training.agentic`) and the per-turn outcome they read
(`agents.driver.turn_outcome`), on episodes whose answers are worked out by hand."""

from __future__ import annotations

import pytest

from tmax.agents.driver import turn_outcome
from tmax.common.records import StepTiming
from tmax.training.agentic import EpisodeShape, agentic_metrics, by_depth


def test_turn_outcome_of_each_timing_record():
    assert turn_outcome(StepTiming(step=1, format_error=True, reason="no call")) == "format"
    assert turn_outcome(StepTiming(step=2, rejected=True, cmd="rm -rf /")) == "rejected"
    assert turn_outcome(StepTiming(step=3, sandbox_error="gone", cmd="ls")) == "sandbox_error"
    assert turn_outcome(StepTiming(step=4, bash_s=0.1, return_code=2, cmd="cat x")) == "failed"
    assert turn_outcome(StepTiming(step=5, bash_s=0.1, return_code=0, cmd="ls")) == "ok"


def test_turns_solved_budget_and_where_errors_fall():
    episodes = [
        # solved in 4 turns; a failed command at turn 0 of 4 (early)
        EpisodeShape(turns=4, status="submitted", solved=True, turn_outcomes=["failed", "ok", "ok", "ok"], depth=3),
        # solved in 6 turns, clean
        EpisodeShape(turns=6, status="submitted", solved=True, turn_outcomes=["ok"] * 6, depth=5),
        # out of steps at 10: failed at turn 4 (mid: 3*4//10 = 1), format error at turn 9 (late)
        EpisodeShape(turns=10, status="max_steps", solved=False,
                     turn_outcomes=["ok"] * 4 + ["failed"] + ["ok"] * 4 + ["format"], depth=5),
        # a format error on the first turn ends it (early)
        EpisodeShape(turns=1, status="format_errors", solved=False, turn_outcomes=["format"], depth=3),
    ]
    m = agentic_metrics(episodes)
    assert m["agentic/turns"] == pytest.approx(21 / 4)
    assert m["agentic/turns_solved"] == pytest.approx(5.0)
    assert m["agentic/max_steps_rate"] == pytest.approx(0.25)
    assert m["agentic/context_end_rate"] == 0.0
    assert m["agentic/failed_commands_per_episode"] == pytest.approx(0.5)
    assert (m["agentic/failed_commands_early"], m["agentic/failed_commands_mid"],
            m["agentic/failed_commands_late"]) == (0.5, 0.5, 0.0)
    assert (m["agentic/format_errors_early"], m["agentic/format_errors_late"]) == (0.5, 0.5)
    rates = by_depth(episodes)
    assert {d: (r.passed, r.trials) for d, r in rates.items()} == {"3": (1, 2), "5": (1, 2)}


def test_no_episode_is_no_measure_and_no_solved_episode_has_no_solved_turns():
    assert agentic_metrics([]) == {}
    m = agentic_metrics([EpisodeShape(turns=3, status="max_steps", solved=False)], prefix="")
    assert "turns_solved" not in m and m["max_steps_rate"] == 1.0
    assert "format_errors_early" not in m and m["format_errors_per_episode"] == 0.0
