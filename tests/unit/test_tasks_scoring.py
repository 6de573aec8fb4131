"""Scoring by the paper's protocol: errors count 0, infra errors reported apart, unbiased pass@k."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest

from tmax.tasks.harbor import TrialScore
from tmax.tasks.scoring import TrialRow, pass_at_k, score


def test_pass_at_k_formula():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2))
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k failures: some success is certain
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def _trials(spec: dict[str, list[str]]) -> list[TrialRow]:
    out = []
    for task, outcomes in spec.items():
        for i, o in enumerate(outcomes):
            reward = {"pass": 1.0, "fail": 0.0, "agent_timeout": 0.0}.get(o)
            out.append(TrialRow(task, f"{task}__{i}", TrialScore(o, reward), category=task.split("-")[0]))
    return out


def test_errors_count_zero_and_infra_reported_apart():
    trials = _trials({
        "a-x": ["pass", "pass", "fail", "infra_error"],
        "b-y": ["fail", "verifier_error", "agent_timeout", "pass"],
    })
    sc = score(trials)
    assert sc.n_trials == 8
    assert sc.mean_reward == pytest.approx(3 / 8)
    assert sc.mean_reward_excl_infra == pytest.approx(3 / 7)
    assert sc.n_infra_errors == 1 and sc.n_errors == 3
    # pass@k over each task's scored attempts: a-x's infrastructure error is left out.
    assert sc.pass_at_k[1] == pytest.approx((2 / 3 + 1 / 4) / 2)
    assert sc.pass_at_k[3] == pytest.approx((1.0 + (1 - 1 / 4)) / 2)
    assert set(sc.pass_at_k) == {1, 2, 3}
    rows = {r.task: r for r in sc.tasks}
    assert rows["a-x"].successes == 2 and rows["b-y"].outcomes["verifier_error"] == 1
    assert sc.categories == {"a": pytest.approx(0.5), "b": pytest.approx(0.25)}


def test_reproduces_harbor_pass_at_k_for_a_89x5_job():
    """The shape of the tmax-9b TB2 job: 121 successes over 89 tasks x 5 attempts is 27.19 %."""
    per_task = [5] * 12 + [4] * 6 + [3] * 6 + [2] * 7 + [1] * 5 + [0] * 53
    assert len(per_task) == 89 and sum(per_task) == 121
    trials = []
    for i, c in enumerate(per_task):
        trials += _trials({f"t{i}": ["pass"] * c + ["fail"] * (5 - c)})
    sc = score(trials)
    assert round(sc.mean_reward * 100, 2) == 27.19
    assert sc.pass_at_k[5] == pytest.approx(36 / 89)
    expected = {k: sum(pass_at_k(5, c, k) for c in per_task) / 89 for k in range(1, 6)}
    assert sc.pass_at_k == pytest.approx(expected)
    assert sc.pass_at_k[1] == pytest.approx(sc.mean_reward)


def test_report_json_on_a_job_dir(tmp_path):
    """`tmax bench report --json` on a hand-written Harbor-style job directory."""
    from typer.testing import CliRunner

    from tmax.cli.main import app

    job = tmp_path / "job"
    job.mkdir()
    (job / "config.json").write_text("{}")
    rows = [("a", 1.0, None), ("a", 0.0, None), ("b", None, "AgentTimeoutError"), ("b", None, "DaytonaError")]
    for i, (task, reward, exc) in enumerate(rows):
        d = job / f"{task}__{i:07d}"
        d.mkdir()
        (d / "result.json").write_text(json.dumps({
            "task_name": task, "trial_name": d.name,
            "verifier_result": {"rewards": {"reward": reward}} if reward is not None else None,
            "exception_info": {"exception_type": exc} if exc else None}))
    r = CliRunner().invoke(app, ["bench", "report", str(job), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["mean_reward"] == pytest.approx(0.25)
    assert data["mean_reward_excl_infra"] == pytest.approx(1 / 3)
    assert data["outcomes"] == {"pass": 1, "fail": 1, "agent_timeout": 1, "infra_error": 1}
    # b has one scored attempt (its DaytonaError is left out): pass@1 only.
    assert data["pass_at_k"] == {"1": pytest.approx(0.25)}
    for p in data["charts"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(app, ["bench", "report", str(job), "--no-chart"])
    assert r.exit_code == 0 and "mean reward 25.00%" in r.output


def test_report_on_missing_dir(tmp_path):
    from typer.testing import CliRunner

    from tmax.cli.main import app

    r = CliRunner().invoke(app, ["bench", "report", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not a job directory" in " ".join(r.output.split())
