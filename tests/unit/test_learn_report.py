"""What a person sees of a `tmax learn` run: the line per step of a run whose output is a
log (`training.report.StepLines`), and `tmax learn report RUN` (`training.run_report.RunReport`
and its rendering), on run directories written by the run's own writers (`MetricsSink`,
`RecipeResult`)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tmax.cli.learn_report import render, sparkline
from tmax.cli.main import app
from tmax.common.files import write_json_atomic
from tmax.training.recipe import HeldoutEval, RecipeResult, SftStage
from tmax.training.report import MetricsSink, StepFigures, StepLines, duration
from tmax.training.run_report import RunReport

ALARMS = [{"signal": "reward", "value": 0.0, "baseline": 0.5, "threshold": 0.2, "role": "outcome"}]
ROLLBACK = {"kind": "rollback", "step": 3, "to_step": 1, "steps_lost": 2, "remedy": "lower_lr", "lr_scale": 0.5,
            "group_size": 8, "rollback": 1, "alarms": ALARMS}


def _step(i: int, reward: float, episodes: int, **extra) -> dict:
    """A step's metrics with the keys the report reads, as `training.trainer` logs them."""
    return {"train/reward_all_rollouts": reward, "episode": float(episodes), "time/total": 10.0 * i,
            "perf/sampled_tokens": 500.0, "learner/tokens": 8000.0, "time/training": 2.0, **extra}


def _rl_run(run: Path) -> None:
    with MetricsSink(run) as sink:
        sink.log(1, _step(1, 0.25, 70))
        sink.log(2, _step(2, 0.5, 140))
        sink.log(3, _step(3, 0.0, 210, **{"guard/event": ROLLBACK}))
        sink.log(2, _step(4, 0.625, 280))  # back at step 1, the step after it
        sink.log(3, _step(5, 0.875, 350))


def test_a_step_line_says_step_reward_heldout_episodes_pace_and_eta():
    lines: list[str] = []
    shown = StepLines(lines.append)
    shown.begin(total=20, done=0)
    fig = StepFigures.of(4, {"train/reward_all_rollouts": 0.4567, "episode": 300.0, "loss/policy_avg": 0.1})
    assert fig.figures["loss"] == "0.1" and (fig.reward, fig.episodes) == (0.4567, 300)
    assert shown.line(fig, elapsed_s=40.0, updates=4) == ("step 4/20: reward 0.457, 300 episodes, 10.0 s/step, "
                                                          "ETA 2m 40s")
    shown.heldout("SFT", 0.390625)
    assert shown.line(fig, 40.0, 4) == ("step 4/20: reward 0.457, held-out SFT 39.1%, 300 episodes, 10.0 s/step, "
                                        "ETA 2m 40s")
    # A resumed run (at step 10) or one a rollback moved back paces on the steps it trained.
    assert shown.line(StepFigures.of(12, {}), 30.0, 2) == ("step 12/20: reward -, held-out SFT 39.1%, 0 episodes, "
                                                           "15.0 s/step, ETA 2m 00s")
    shown.update(fig)
    shown.note("a guard event")
    assert lines[0].startswith("step 4/20: reward 0.457") and lines[1] == "a guard event"
    assert (duration(59.6), duration(3725)) == ("1m 00s", "1h 02m")


def test_report_of_a_learn_run(tmp_path):
    run = tmp_path / "run"
    _rl_run(run)
    write_json_atomic(run / "summary.json", {"steps": 3, "setup_s": 12.5, "run_s": 50.0, "guard": {}})
    rep = RunReport.read(run)
    assert (rep.recipe, rep.steps, rep.updates, rep.episodes) == (False, 3, 5, 350)
    assert rep.rewards == [0.25, 0.5, 0.0, 0.625, 0.875]
    assert rep.stage_seconds == {"setup_s": 12.5, "rl_s": 50.0} and rep.heldout_before is None
    # 350 episodes in the loop's 50 s; 5 x 500 sampled tokens in 50 s; 5 x 8000 learner tokens in 5 x 2 s.
    t = rep.throughput
    assert (t.episodes_per_min, t.sampled_tokens_per_s, t.learner_tokens_per_s) == (420.0, 50.0, 4000.0)
    assert (rep.guard.rollbacks, rep.guard.steps_lost) == (1, 2) and rep.guard.events[0].to_step == 1
    text = "\n".join(render(rep))
    assert "held-out" not in text  # no held-out eval in a plain run
    assert "time: actors 12s, RL 50s" in text
    assert "RL: 3 steps (5 trained), 350 episodes; training reward 0.25 -> 0.88 (first -> last quarter)" in text
    assert "reward per step  ▃▅▁▅▇  (scale 0 to 1)" in text
    assert "throughput: 420 episodes/min, 50 sampled tokens/s, 4,000 learner tokens/s" in text
    assert "step 3: collapse (reward) -> back to step 1, lower_lr (LR x0.5)" in text


def _recipe(out: Path) -> RecipeResult:
    def ev(rate: float) -> HeldoutEval:
        return HeldoutEval(pass_rate=rate, passed=round(rate * 128), trials=128, infra_errors=0, seconds=11.0,
                           job_dir=str(out / "eval"))

    res = RecipeResult(seed=2, sft=SftStage(checkpoint=str(out / "sft")), sft_eval=ev(0.390625), rl_eval=ev(0.859375),
                       times={"build_s": 3.0, "environments_s": 1.5, "sft_s": 164.0, "engine_start_s": 10.0,
                              "sft_eval_s": 11.0, "rl_s": 150.0, "rl_eval_s": 11.0, "total_s": 354.0},
                       cpu_times={"sft_s": 330.0, "rl_s": 290.0, "total_s": 700.0})
    write_json_atomic(out / "recipe.json", res.model_dump(mode="json"))
    return res


def test_report_of_a_recipe_directory_and_its_json(tmp_path, monkeypatch):
    """`tmax learn report runs/nano` on a recipe directory, and `--json` read back into the record."""
    monkeypatch.chdir(tmp_path)
    out = Path("runs/nano")
    _rl_run(out / "rl")
    _recipe(out)
    res = CliRunner().invoke(app, ["learn", "report", "runs/nano"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "run runs/nano (nano recipe, seed 2)"
    assert lines[1] == "held-out pass rate: before RL 39.1% -> after 85.9% (+46.9 points)"
    # CPU seconds where the record has them (a stage without is shown with its wall time only).
    assert lines[2] == ("time: build 3s, environments 2s, SFT 2m 44s (CPU 5m 30s), engine start 10s, SFT eval 11s, "
                        "RL 2m 30s (CPU 4m 50s), RL eval 11s; total 5.9 min, CPU 11.7 min on the run's processes")
    res = CliRunner().invoke(app, ["learn", "report", "runs/nano", "--json"])
    assert res.exit_code == 0, res.output
    rep = RunReport.model_validate_json(res.output)
    assert rep == RunReport.read(out) and rep.gain_points == 46.9 and rep.seed == 2
    assert json.loads(res.output)["throughput"]["episodes_per_min"] == 420.0


def test_report_of_a_recipe_without_rl_and_of_no_run(tmp_path):
    out = tmp_path / "sft-only"
    out.mkdir()
    res = _recipe(out).model_copy(update={"rl_eval": None})
    write_json_atomic(out / "recipe.json", res.model_dump(mode="json"))
    text = "\n".join(render(RunReport.read(out)))
    assert "before RL 39.1% -> after -" in text and "RL: no step logged" in text
    r = CliRunner().invoke(app, ["learn", "report", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no metrics.jsonl" in r.output


def test_sparkline_is_on_a_fixed_scale():
    assert sparkline([0.0, 0.5, 1.0, None, 2.0, -1.0]) == "▁▅█ █▁"


LIBRARY_NOISE = '''
import logging, os, subprocess, sys, warnings
from pathlib import Path
handler = logging.StreamHandler(sys.stderr)  # a library's handler, made at its import
logging.getLogger("lib").addHandler(handler)
from tmax.cli.library_logs import library_logs
with library_logs(Path(sys.argv[1])) as log:
    os.write(2, b"[2026-12-07 17:02:57,048 E 1 1] core_worker.cc:2465: Actor with class name ...\\n")
    logging.getLogger("lib").warning("a library warning")
    logging.getLogger("no.handler").warning("a record no handler takes")
    warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)
    subprocess.run(["sh", "-c", "echo a child process writes >&2"], check=True)
    print("step 1/20: ours", file=sys.stderr)
print("after the run", file=sys.stderr)
'''


def test_library_output_goes_to_the_run_log_and_ours_to_the_user(tmp_path):
    """What Ray's core worker (C++, descriptor 2), library loggers, Python warnings and child
    processes write during a run lands in RUN/logs/driver.log; tmax's own lines reach stderr."""
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-W", "always", "-c", LIBRARY_NOISE, str(run)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["step 1/20: ours", "after the run"]
    log = (run / "logs" / "driver.log").read_text()
    for noise in ("core_worker.cc:2465", "a library warning", "a record no handler takes",
                  "DeprecationWarning: a deprecation", "a child process writes"):
        assert noise in log, log
    # A run that stopped before any library wrote leaves no directory behind.
    quiet = tmp_path / "quiet"
    proc = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path\n"
                           "from tmax.cli.library_logs import library_logs\n"
                           "with library_logs(Path(sys.argv[1])): print('bad input', file=sys.stderr)", str(quiet)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stderr == "bad input\n" and not quiet.exists()
