"""The collapse guard: the detector on recorded metric series (real collapses, healthy
runs whose one-step dips recovered by themselves, a noisy run that did not collapse, an
infrastructure-error burst on it), checkpoint health marks and resume, the learner's
in-place restore, the health signals and what a run reports.

The series in tests/data/guard are `metrics.jsonl` rows of `benchmarks/collapse_guard.py`
runs (`recipe_podman_seed0` and `late_collapse_podman_seed0` of `benchmarks/nano_recipe.py`),
cut to what the guard reads (5 significant digits). `healthy_*_seed{N}` are the nano
preset's LR (5e-4, 20 steps) from one SFT checkpoint (recipe seed 0), RL seed N:
`healthy_off_*` with the guard off, `healthy_on_patience1_*` with the guard on as first
shipped (a collapse at the first step meeting the rule), `healthy_on_*` with it now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from documented import documented
from tmax.agents.policy import TokenTrace
from tmax.training.guard import Detector, DetectorConfig, replay
from tmax.common.records import CHECKPOINT_META, CheckpointExtra, GuardSummary
from tmax.training.learner import checkpoint as ckpt
from tmax.training.report import guard_report, health_metrics, read_metrics, reward_curve, run_summary
from tmax.training.rollout import Rollout

DATA = Path(__file__).parents[1] / "data" / "guard"


def _series(name: str) -> list[dict]:
    return read_metrics(DATA / name)


def _replay_rolls_back_where_the_run_did(rows: list[dict]) -> list[int]:
    """The steps the recorded run rolled back at, checked to be exactly the rows where the
    detector, replayed, gives a collapse."""
    rolled_back = [i for i, r in enumerate(rows) if "guard/event" in r]
    verdicts = replay(rows)
    assert [i for i, v in enumerate(verdicts) if v.collapse] == rolled_back, [v.describe() for v in verdicts]
    return [rows[i]["step"] for i in rolled_back]


# -- the detector on recorded series -------------------------------------------------------


def test_recorded_collapse_is_detected_at_the_step_it_shows():
    """Recorded: the nano RL stage at LR 2e-3 (benchmarks/collapse_guard.py, seed 0, from a
    96-step SFT) up to its collapse: format errors 0.47 -> 0.98, submits 0.52 -> 0.02. The
    last row is the guard's judgement of a stall (no batch filled any more). The detector
    fires there, not before (steps 1-4 swing by +-0.2 and are not collapses)."""
    rows = _series("collapse_lr2e-3.jsonl")
    verdicts = replay(rows)
    gone = next(i for i, r in enumerate(rows) if r["health/submit_rate"] < 0.1)
    assert [v.collapse for v in verdicts] == [i == gone for i in range(len(rows))], [v.describe() for v in verdicts]
    fired = verdicts[gone]
    assert {a.role for a in fired.alarms} == {"outcome", "policy"}, fired.describe()
    assert {"format_errors", "submit_rate"} <= {a.signal for a in fired.alarms}


def test_recorded_noisy_run_never_triggers():
    """Recorded: the same RL stage with the guard off, which had not collapsed by its last
    step: format errors swing 0.44 -> 0.72 -> 0.54 -> 0.78 -> 0.44, and the first step's
    logprob difference is exactly 0 (no update yet), the next ones 4-11. Step 2 alarms on
    outcomes alone (format errors, submits), which is not a collapse. Judged from that
    first step, the logprob differences would have supplied the policy alarm: why they
    wait for two steps of baseline."""
    import dataclasses

    from tmax.training import guard

    rows = _series("noisy_lr2e-3.jsonl")
    assert len(rows) >= 5
    verdicts = replay(rows)
    assert not any(v.collapse for v in verdicts), [v.describe() for v in verdicts if v.alarms]
    assert {a.role for a in verdicts[1].alarms} == {"outcome"}, verdicts[1].describe()
    eager = tuple(dataclasses.replace(s, min_history=1) for s in guard.SIGNALS)
    d = Detector(DetectorConfig(patience=1), signals=eager)
    assert [d.judge(int(r["step"]), r).status for r in rows[:2]] == ["warming", "collapse"]


def test_recorded_fast_collapse_is_caught_at_its_second_step():
    """Recorded: the nano RL stage at LR 5e-3 from the preset's SFT (seed 0, guard off),
    collapsed from its second step: format errors 0.06 -> 0.57 -> 0.73, submits 0.94 ->
    0.43, entropy up, identical samples down (varied garbage, not one command), until no
    group had mixed rewards and the run gave up. Step 2 meets the rule, judged against
    step 1 alone (the signals' floors, not a spread that the collapse itself would widen),
    and stays out of the baseline; step 3, still there, confirms it."""
    rows = _series("collapse_lr5e-3.jsonl")
    verdicts = replay(rows)
    assert [v.status for v in verdicts[:3]] == ["warming", "alarm", "collapse"], [v.describe() for v in verdicts]
    signals = {a.signal for a in verdicts[1].alarms}
    assert {"format_errors", "submit_rate"} <= signals and {"entropy", "identical"} <= signals
    assert {"format_errors", "submit_rate", "identical"} <= {a.signal for a in verdicts[2].alarms}



def test_recorded_guarded_collapse_is_rolled_back_where_the_run_did_and_then_trains_on():
    """Recorded: the nano RL stage at LR 2e-3 with the guard on as it is now (seed 0, the
    benchmark's SFT checkpoint; its guard-off twin collapsed and gave up after 3 steps,
    held-out 18.0 %). The run rolled back at step 2 (reward 0, format errors 0.47, submits
    0.11) to step 0 at LR x 0.5, and at step 7 to step 0 again at x 0.25, then trained its
    20 steps without a collapse (held-out 85.9 %). Replayed, the detector gives a collapse
    on exactly the two rows the run rolled back at and none after."""
    rows = _series("collapse_on_lr2e-3.jsonl")
    assert _replay_rolls_back_where_the_run_did(rows) == [2, 7]
    assert rows[-1]["step"] == 20 and rows[-1]["lr"] == pytest.approx(2e-3 * 0.25)  # past its warmup


def test_recorded_podman_recipe_rollback_is_where_the_run_went_back_and_none_after():
    """Recorded: the nano-podman recipe's RL stage (seed 0, the preset's LR, guard on). Steps
    12 and 13 met the rule (format errors 0.375 against 0.08, submits 0.54 against 0.91,
    longer responses, logprob differences up) and the run went back to step 0 at LR x 0.5
    (its step-10 checkpoint was not yet confirmed: step 12 alarmed inside its window), then
    trained its 20 steps with no other collapse (held-out 25.8 % -> 79.7 %; the host recipe
    of the same seed 32.0 % -> 75.0 % with none). Whether steps 12-13 would have recovered
    on their own is not known. Replayed: a collapse on exactly the row the run rolled back
    at, and none after it."""
    rows = _series("recipe_podman_seed0.jsonl")
    assert _replay_rolls_back_where_the_run_did(rows) == [13]
    assert rows[-1]["step"] == 20 and len(rows) == 33


def test_recorded_healthy_recipe_never_triggers():
    """Recorded: the default nano recipe's 20 RL steps (seed 0; held-out 25.8 % -> 75.8 %).
    A policy that sharpens as it learns alarms now and then (logprob differences, more
    identical samples), never on an outcome at the same step."""
    verdicts = replay(_series("healthy_nano_seed0.jsonl"))
    assert len(verdicts) == 20
    assert not any(v.collapse for v in verdicts), [v.describe() for v in verdicts if v.alarms]


def test_recorded_late_collapse_whose_policy_change_came_first_is_caught():
    """Recorded: the nano-podman recipe's RL stage (seed 0, guard on as it was then), token
    for token the host run's rollouts until step 10, then its own (asynchronous batches).
    Steps 12-19 all alarmed: grad norm and the logprob differences at 12-16, format errors
    at 14 and 17, the reward 0.07 and 0.06 at 18 and 19 (a baseline of 0.46), held-out gain
    +10.9 points against the host's +51.6. Never a policy and an outcome alarm at two steps
    in a row, so the run went on untouched; with a policy change earlier in the same run of
    alarm steps counting, steps 17 and 18 meet the rule and 18 is the collapse (step 17 now
    stays out of the baseline, so 18 alarms on format errors and submits too)."""
    rows = _series("late_collapse_podman_seed0.jsonl")
    verdicts = replay(rows)
    assert [v.status for v in verdicts[11:18]] == ["alarm"] * 6 + ["collapse"]
    assert {a.signal for a in verdicts[17].alarms} == {"reward", "format_errors", "submit_rate"}
    assert not any(a.role == "policy" for a in verdicts[16].alarms + verdicts[17].alarms)
    # A step with no alarm at all ends the run: the same reward dips after a clean step
    # are noise again.
    clean = dict(rows[10], step=17)
    assert not any(v.collapse for v in replay(rows[:16] + [clean] + [dict(r, step=r["step"] + 1) for r in rows[16:18]]))


HEALTHY = sorted(p.name for p in DATA.glob("healthy_*.jsonl"))


@pytest.mark.parametrize("name", HEALTHY)
def test_recorded_healthy_runs_are_not_rolled_back(name):
    """Every recorded healthy run at the preset's LR, replayed: no collapse (and a run that
    had the guard on as it is now recorded no rollback either)."""
    rows = _series(name)
    verdicts = replay(rows)
    assert not any(v.collapse for v in verdicts), [v.describe() for v in verdicts if v.alarms]
    if name.startswith("healthy_on_seed"):
        assert not any("guard/event" in r for r in rows)


def test_one_step_dips_of_healthy_runs_recover_at_the_next_step():
    """The three dips of the healthy runs that met the rule, or came close: each is back in
    range at the next step, which a collapse is not. As first shipped (patience 1) the guard
    rolled back seed 2 at step 6 (the recorded event: to step 2, LR halved for the rest of
    the run) and would have rolled back seed 0 (guard off) at step 3; the guard-off run of
    seed 2 had the same dip at step 6 (format errors 0.35, grad norm 0.36) and was at 0.11
    the step after."""
    first = DetectorConfig(patience=1)
    off0 = _series("healthy_off_seed0.jsonl")
    assert [v.step for v in replay(off0, first) if v.collapse] == [3]
    v = replay(off0)
    assert v[2].status == "alarm" and {"submit_rate", "length"} <= {a.signal for a in v[2].alarms}
    assert not any(a.role == "outcome" for a in v[3].alarms), v[3].describe()

    on2 = _series("healthy_on_patience1_seed2.jsonl")
    event = next(r for r in on2 if "guard/event" in r)
    assert (event["step"], event["guard/event"]["to_step"], event["guard/event"]["lr_scale"]) == (6, 2, 0.5)
    assert [v.step for v in replay(on2[:6], first) if v.collapse] == [6]
    assert replay(on2[:6])[5].status == "alarm"
    off2 = _series("healthy_off_seed2.jsonl")
    assert off2[5]["health/format_error_rate"] > 0.3 and off2[6]["health/format_error_rate"] < 0.15
    assert all(a.role == "policy" for a in replay(off2)[6].alarms)

    # Seed 1 dipped deepest (format errors 0.80, submits 0.20), with no policy alarm, and
    # was back at 0.13 the step after.
    on1 = replay(_series("healthy_on_patience1_seed1.jsonl"))
    assert {a.signal for a in on1[3].alarms} == {"format_errors", "submit_rate"} and on1[4].status == "healthy"


def test_infra_error_burst_is_not_a_collapse():
    """The recorded noisy run with an inference-server outage laid over steps 4-5: half the
    episodes were re-queued as infrastructure failures, and the rest got no completion, so
    they ended at once without a tool call (format errors, no submit, reward 0). Those steps
    are "infra" (not judged, kept out of the baseline) and the run goes on healthy after;
    the same rows without the infra label are judged, and alarm."""
    rows = [dict(r) for r in _series("noisy_lr2e-3.jsonl")]
    for r in rows[3:5]:
        r.update({"health/infra_error_rate": 0.5, "health/reward": 0.0, "health/submit_rate": 0.0,
                  "health/format_error_rate": 1.0, "health/turns": 1.0, "health/response_tokens": 0.0})
    verdicts = replay(rows)
    assert [v.status for v in verdicts[3:5]] == ["infra"] * 2
    assert not any(v.collapse for v in verdicts)
    for r in rows[3:5]:
        r["health/infra_error_rate"] = 0.0
    assert [v.status for v in replay(rows)[3:5]] == ["alarm"] * 2


# -- the rule ------------------------------------------------------------------------------


def _row(step, reward=0.5, fmt=0.05, entropy=0.8, identical=0.2, **extra):
    return {"step": step, "health/episodes": 64.0, "health/reward": reward, "health/format_error_rate": fmt,
            "health/sampled_entropy": entropy, "health/identical_sample_frac": identical, **extra}


def test_rule_needs_an_outcome_and_a_policy_alarm_together():
    base = [_row(i, reward=0.5 + 0.04 * (i % 3)) for i in range(1, 7)]
    eager = DetectorConfig(patience=1)
    # A reward dip alone (the policy unchanged) is noise.
    assert not any(v.collapse for v in replay(base + [_row(7, reward=0.1)] * 2))
    # A sharper policy with rising reward is learning.
    assert not any(v.collapse for v in replay(base + [_row(7, reward=0.9, entropy=0.2, identical=0.9)] * 2))
    # Both together: the rule is met, naming the signals.
    v = replay(base + [_row(7, reward=0.05, fmt=0.8, entropy=0.2, identical=0.9)], eager)[-1]
    assert v.collapse and {a.signal for a in v.alarms} == {"reward", "format_errors", "entropy", "identical"}


def test_a_collapse_is_the_second_step_in_a_row_that_meets_the_rule():
    base = [_row(i, reward=0.5 + 0.04 * (i % 3)) for i in range(1, 7)]
    bad = [_row(7, reward=0.05, fmt=0.8, entropy=0.2), _row(8, reward=0.0, fmt=0.9, entropy=0.1)]
    assert [v.status for v in replay(base + bad)[-2:]] == ["alarm", "collapse"]
    assert replay(base + bad, DetectorConfig(patience=1))[-2].collapse
    # A dip that is back in range at the next step: no collapse, and the dip stays out of
    # the baseline (a second dip later is measured against the healthy steps, not it).
    d = Detector()
    verdicts = [d.judge(int(r["step"]), r) for r in base + [bad[0], _row(8), _row(9)]]
    assert [v.status for v in verdicts[-3:]] == ["alarm", "healthy", "healthy"]
    assert 7 not in [s for s, _ in d.history] and d.streak == 0
    # A stall that meets the rule is a collapse at once: the zero-variance groups in a row
    # that led to it are the persistence; it does not join the baseline either.
    d = Detector()
    for r in base:
        d.judge(int(r["step"]), r)
    assert d.judge(7, bad[0], stall=True).collapse and [s for s, _ in d.history][-1] == 6
    d.rewind(6)
    assert not d.judge(7, _row(7), stall=True).alarms and [s for s, _ in d.history][-1] == 6


def test_non_finite_update_is_a_collapse_at_once_and_rewind_forgets():
    d = Detector()
    for i in range(1, 5):
        d.judge(i, _row(i))
    v = d.judge(5, _row(5, **{"optim/grad_norm": "nan"}))
    assert v.collapse and v.alarms[0].signal == "optim/grad_norm"
    d.rewind(2)
    assert [s for s, _ in d.history] == [1, 2] and d.streak == 0


def test_spread_widens_the_limit_for_noisy_signals():
    noisy = [_row(i, reward=[0.2, 0.8, 0.3, 0.7, 0.25, 0.75][i - 1]) for i in range(1, 7)]
    # A drop to 0.1 is inside the noise of a signal that swings +-0.3.
    assert not any(a.signal == "reward" for a in replay(noisy + [_row(7, reward=0.1, fmt=0.9)])[-1].alarms)


# -- health signals ------------------------------------------------------------------------


def _rollout(group, ids, reward=1.0, status="submitted", logprobs=None, steps=2):
    n = len(ids)
    trace = TokenTrace([1], list(ids), logprobs or [-0.5] * n, [1] * n, [0] * steps)
    return Rollout("t", group, 0, 0, trace, reward, status, steps, 0, False, status == "submitted")


def test_health_metrics_over_every_episode_since_the_step():
    rs = [_rollout(0, [5, 6]), _rollout(0, [5, 6]), _rollout(0, [5, 6]), _rollout(0, [7]),
          _rollout(1, [9], 0.0, "format_errors", [-2.0], steps=1), _rollout(1, [8], 0.0, "format_errors", [-2.0], steps=1)]
    m = health_metrics(rs, requeued=2)
    assert m["health/format_error_rate"] == pytest.approx(2 / 6)
    assert m["health/submit_rate"] == pytest.approx(4 / 6)
    # Group 0: 4 samples, 2 distinct -> (4 - 2) / 3; group 1: all differ -> 0.
    assert m["health/identical_sample_frac"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["health/sampled_entropy"] == pytest.approx((7 * 0.5 + 2 * 2.0) / 9)
    assert m["health/turns"] == pytest.approx(10 / 6) and m["health/response_tokens"] == pytest.approx(9 / 6)
    assert m["health/infra_error_rate"] == pytest.approx(2 / 8)
    assert m["health/reward"] == pytest.approx(4 / 6) and m["health/episodes"] == 6
    # No episode finished during the step: nothing measured, rather than rates of 0.
    assert health_metrics([], requeued=3) == {"health/episodes": 0.0, "health/infra_error_rate": 1.0}


def test_rollout_signals_of_a_handful_of_episodes_are_not_judged():
    base = [_row(i) for i in range(1, 5)]
    few = _row(5, reward=0.0, fmt=1.0, entropy=0.1, identical=1.0, **{"health/episodes": 3.0})
    assert replay(base + [few])[-1].status == "healthy"
    assert replay(base + [few], DetectorConfig(min_episodes=2, patience=1))[-1].collapse


# -- checkpoints: health marks, pruning, resume ---------------------------------------------


def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    p = ckpt.checkpoint_path(run_dir, step)
    p.mkdir(parents=True)
    torch.save({"format": 1, "step": step, "rng": ckpt.rng_state(), "optimizer": {"state": {}, "param_groups": []}},
               p / ckpt.STATE_PT)
    (p / CHECKPOINT_META).write_text(json.dumps({"step": step, "extra": {"prompt_position": step}}))
    return p


def test_health_marks_steer_resume_and_pruning(tmp_path):
    from tmax.training.learner.checkpoint import resume_point

    for step in (0, 2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    ckpt.mark_health(ckpt.checkpoint_path(tmp_path, 0), "healthy")
    ckpt.mark_health(ckpt.checkpoint_path(tmp_path, 2), "healthy")
    for step in (4, 6):
        ckpt.mark_health(ckpt.checkpoint_path(tmp_path, step), "collapsed", {"detected_at": 7})
    assert ckpt.health(ckpt.checkpoint_path(tmp_path, 4)) == "collapsed"
    # --resume never continues from a checkpoint the guard rolled back past.
    assert resume_point(tmp_path)[0] == 2
    assert ckpt.latest_checkpoint(tmp_path, healthy_only=True).name == "step_2"
    with pytest.raises(ValueError, match="not a valid HealthMark"):
        ckpt.mark_health(ckpt.checkpoint_path(tmp_path, 2), "fine")
    # Pruning to one keeps the newest, and the rollback target.
    removed = ckpt.prune_checkpoints(tmp_path, keep=1)
    assert [p.name for p in removed] == ["step_0", "step_4"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_2", "step_6"]
    # An unjudged checkpoint (a run without the guard) is resumed as before.
    _fake_checkpoint(tmp_path, 8)
    assert resume_point(tmp_path)[0] == 8


def test_learner_restores_a_checkpoint_in_place(tmp_path):
    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.packing import TrainSample
    from tmax.training.nano.model import build_nano_model

    build_nano_model(tmp_path / "m", seed=0)
    learner = Learner(tmp_path / "m", LearnerConfig(lr=1e-2, warmup_steps=4))
    g = torch.Generator().manual_seed(0)

    def batch():
        out = []
        for adv in (1.0, -1.0):
            ids = torch.randint(10, 200, (8,), generator=g).tolist()
            out.append(TrainSample(TokenTrace([1, 2, 3], ids, [-3.0] * 8, [1] * 8), adv))
        return out

    learner.train_step(batch())
    saved = learner.save(tmp_path / "ck", extra=CheckpointExtra(prompt_position=1))
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    opt_before = learner.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    learner.train_step(batch())
    learner.train_step(batch())
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    assert learner.restore(saved, lr_scale=0.5) == 1
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    assert torch.equal(learner.optimizer.state_dict()["state"][0]["exp_avg"], opt_before)
    assert learner.step == 1 and learner.extra == CheckpointExtra(prompt_position=1)
    # The remedy scales the schedule: warmup step 2 of 4 at half the LR.
    assert learner.current_lr() == pytest.approx(1e-2 * 0.5 * 2 / 4)


# -- what a run reports -----------------------------------------------------------------------


def _event_rows() -> list[dict]:
    alarms = [{"signal": "reward", "value": 0.0, "baseline": 0.5, "threshold": 0.2, "role": "outcome"},
              {"signal": "identical", "value": 1.0, "baseline": 0.3, "threshold": 0.25, "role": "policy"}]
    rows = [{"step": i, "train/reward_all_rollouts": 0.5} for i in (1, 2, 3)]
    rows.append({"step": 4, "train/reward_all_rollouts": 0.0, "guard/rollback": 1.0,
                 "guard/event": {"kind": "rollback", "step": 4, "to_step": 2, "steps_lost": 2, "remedy": "lower_lr",
                                 "lr_scale": 0.5, "group_size": 8, "rollback": 1, "alarms": alarms}})
    rows += [{"step": i, "train/reward_all_rollouts": 0.6} for i in (3, 4, 5)]
    return rows


def test_summary_report_and_curve_show_rollbacks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _event_rows()))
    summ = run_summary(path, 1.0, 2.0)
    assert summ.steps == 5 and summ.updates == 7
    g = summ.guard
    assert (g.rollbacks, g.steps_lost, g.stopped) == (1, 2, False)
    text = "\n".join(guard_report(g))
    assert "step 4: collapse (reward, identical) -> back to step 2, lower_lr (LR x0.5)" in text
    assert "reward 0.0 (baseline 0.5, limit +-0.2)" in text
    assert Path(reward_curve(path, tmp_path / "curve.png")).stat().st_size > 1000
    assert guard_report(GuardSummary()) == ["collapse guard: no rollback"]


def test_cli_learn_report_lists_events_with_their_signals(tmp_path, monkeypatch):
    """The README's `tmax learn report runs/nano`, on a nano recipe directory (RL run in rl/)."""
    from typer.testing import CliRunner

    from tmax.cli.main import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "nano" / "rl").mkdir(parents=True)
    (tmp_path / "runs" / "nano" / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _event_rows()))
    res = CliRunner().invoke(app, documented("tmax learn report runs/nano")[1:])
    assert res.exit_code == 0, res.output
    assert "1 rollback(s), 2 step(s) lost" in res.output and "identical 1.0 (baseline 0.3" in res.output
    res = CliRunner().invoke(app, ["learn", "report", str(tmp_path / "nothing")])
    assert res.exit_code == 2 and "no metrics.jsonl" in res.output


def test_guard_section_of_the_config(tmp_path):
    from tmax.training.config import ConfigError, dump_toml, load_config, preset

    p = tmp_path / "c.toml"
    p.write_text('extends = "nano"\n[guard]\nenabled = true\nremedy = "raise_group_size"\nmax_rollbacks = 2\n')
    cfg = load_config(p)
    assert cfg.guard.enabled and cfg.guard.remedy == "raise_group_size" and cfg.guard.detector().patience == 2
    assert "[guard]" in dump_toml(cfg)
    p.write_text('extends = "nano"\n[guard]\nremedy = "pray"\n')
    with pytest.raises(ConfigError, match="guard.remedy"):
        load_config(p)
    assert not preset("tmax-9b").guard.enabled
