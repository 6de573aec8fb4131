"""benchmarks/run_divergence.py: episodes of two runs matched by task, sample and policy
version, and each run's asynchrony figures, on run directories written as `tmax learn`
writes them (`Rollout.to_json`, metrics rows)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.run_divergence import identical_by_version, load_rollouts, run_figures  # noqa: E402
from tmax.agents.policy import TokenTrace  # noqa: E402
from tmax.training.rollout import Rollout  # noqa: E402


def _rollout(task: str, sample: int, version: int, ids: list[int], versions: list[int] | None = None,
             status: str = "submitted") -> Rollout:
    trace = TokenTrace(prompt_ids=[1, 2], ids=ids, logprobs=[0.0] * len(ids), mask=[1] * len(ids),
                       turn_versions=versions or [version])
    return Rollout(task_id=task, group_id=0, sample_index=sample, seed=sample, trace=trace, reward=1.0,
                   status=status, steps=len(trace.turn_versions), policy_version=version)


def _write_run(run: Path, rollouts: list[Rollout], metrics: list[dict]) -> Path:
    run.mkdir()
    (run / "rollouts.jsonl").write_text("".join(r.to_json() + "\n" for r in rollouts))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def test_episodes_match_only_when_the_whole_token_stream_does(tmp_path):
    a = [_rollout("t1", 0, 0, [5, 6]), _rollout("t1", 1, 0, [5, 7]), _rollout("t2", 0, 1, [8])]
    b = [_rollout("t1", 0, 0, [5, 6]), _rollout("t1", 1, 0, [5, 9]), _rollout("t2", 0, 2, [8])]
    # t1/1 sampled another token; t2/0 was sampled by another version in run b.
    assert identical_by_version(a, b) == {0: (2, 1), 1: (1, 0)}
    run = _write_run(tmp_path / "a", a, [])
    assert [r.trace.ids for r in load_rollouts(run)] == [[5, 6], [5, 7], [8]]


def test_run_figures_read_lag_mixed_versions_and_format_errors(tmp_path):
    rollouts = [_rollout("t1", 0, 0, [5, 6], versions=[0, 1]), _rollout("t1", 1, 0, [5, 6], versions=[0, 0]),
                _rollout("t2", 0, 1, [5], status="format_errors")]
    metrics = [{"step": 1, "model_step_mean": 0.0, "model_step_min": 0.0},
               {"step": 2, "model_step_mean": 0.5, "model_step_min": 0.0}]
    fig = run_figures(_write_run(tmp_path / "a", rollouts, metrics), rollouts)
    assert (fig["episodes"], fig["lag_mean"], fig["lag_max"]) == (3, 0.25, 1.0)
    assert (fig["mixed_version_share"], fig["format_error_share"]) == (0.5, 0.333)
    assert fig["guard_collapse_steps"] == []
