"""benchmarks/step_profile.py's per-step arithmetic on a run directory's files."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.step_profile import step_rows  # noqa: E402


def test_step_rows_split_each_step_between_sampler_and_learner(tmp_path):
    def rollout(llm, exe, start, verify):
        return {"timings": {"llm_s": llm, "exec_s": exe, "sandbox_start_s": start, "verifier_s": verify}}

    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        rollout(4.0, 2.0, 1.0, 1.0), rollout(4.0, 2.0, 1.0, 1.0),  # finished during step 1
        rollout(2.0, 0.0, 0.0, 0.0),  # during step 2
    ]))
    step = {"learner/tokens": 900.0, "learner/tokens_computed": 300.0, "learner/loss_tokens": 50.0,
            "time/learner_forward": 1.0, "time/learner_backward": 2.0, "time/learner_optimizer": 0.5,
            "time/weight_sync": 0.25, "time/getting_response": 4.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [
        {**step, "training_step": 1, "time/total": 10.0, "episode": 2},
        {**step, "training_step": 2, "time/total": 15.0, "episode": 3},
    ]))
    first, second = step_rows(tmp_path, concurrency=2)
    assert first["wall_s"] == 10.0 and second["wall_s"] == 5.0
    assert first["seconds"]["sampling"] == 4.0 and first["seconds"]["environment"] == 2.0
    assert first["seconds"]["sampler_idle"] == pytest.approx(10.0 - 4 - 2 - 1 - 1)
    assert second["seconds"]["sampling"] == 1.0 and second["episodes"] == 1
    assert first["share"]["learner_idle"] == 0.4 and first["share"]["learner_backward"] == 0.2
    assert first["learner_tokens_per_loss_token"] == 6.0
    assert first["per_sample_tokens_per_loss_token"] == 18.0
