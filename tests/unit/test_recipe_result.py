"""The nano recipe's result record (`training.recipe.RecipeResult`, `recipe.json`) and the
line `tmax learn nano` closes with. The recipe itself runs in
tests/integration/test_nano_recipe.py and, through the CLI, test_lora_learn.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tmax.cli.learn_cmd import recipe_line
from tmax.training.recipe import HeldoutEval, RecipeResult, RlStage, SftStage


def _eval(passed: int, trials: int = 128) -> HeldoutEval:
    return HeldoutEval(pass_rate=passed / trials, passed=passed, trials=trials, infra_errors=0, seconds=17.2,
                       job_dir="runs/nano/eval/x")


def _result(**over) -> RecipeResult:
    fields = dict(seed=0, sft=SftStage(checkpoint="runs/nano/sft", demos=128, demos_solved=52, steps=256,
                                       final_loss=0.063, demo_s=4.6, train_s=177.2),
                  sft_eval=_eval(34), rl=RlStage(steps=20, checkpoint="runs/nano/rl/checkpoints/step_20",
                                                 summary={"steps": 20}, curve=None),
                  rl_eval=_eval(96), times={"sft_s": 181.9, "rl_s": 233.0, "total_s": 477.3})
    return RecipeResult(**(fields | over))


def test_pass_rates_gain_and_minutes_come_from_the_stages():
    res = _result()
    assert (res.sft_pass_rate, res.rl_pass_rate, res.gain_points, res.minutes_total) == (0.265625, 0.75, 48.4, 7.96)
    # recipe.json carries them beside the stages and reads back to the same record.
    written = json.loads(res.model_dump_json())
    assert (written["sft_pass_rate"], written["rl_pass_rate"], written["gain_points"]) == (0.265625, 0.75, 48.4)
    assert RecipeResult.model_validate(written) == res


def test_a_recipe_without_rl_or_eval_has_no_gain():
    res = _result(rl=None, rl_eval=None)
    assert (res.rl_pass_rate, res.gain_points) == (None, None)
    assert _result(sft_eval=None, rl_eval=None, times={}).minutes_total is None


def test_the_closing_line_names_both_pass_rates_and_the_gain():
    assert recipe_line(_result(), Path("runs/nano/recipe.json")) == (
        "held-out pass rate: SFT 26.6% -> RL 75.0% (+48.4 points); 8.0 min total; runs/nano/recipe.json")
    line = recipe_line(_result(rl_eval=None), Path("runs/nano/recipe.json"))
    assert "RL not evaluated (the run left no final checkpoint)" in line


def test_a_stage_record_with_a_wrong_type_is_refused():
    with pytest.raises(ValueError, match="passed"):
        HeldoutEval(pass_rate=0.5, passed="many", trials=2, infra_errors=0, seconds=1.0, job_dir="x")


def test_a_finished_sft_is_read_back_not_trained_again(tmp_path):
    """sft/sft.json marks SFT done: the stage reads it back (final loss the mean of the last
    tenth of the step losses, as after training) and trains nothing."""
    from tmax.training.recipe import sft_stage

    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "sft.json").write_text(json.dumps({"steps": 20, "demos": 4,
                                                          "losses": [float(i) for i in range(20, 0, -1)]}))
    logged: list[str] = []
    res = sft_stage(None, "unused", None, tmp_path, logged.append)
    assert (res.skipped, res.checkpoint, res.demos, res.steps, res.final_loss) == (True, str(tmp_path / "sft"), 4, 20, 1.5)
    assert logged == [f"SFT checkpoint exists: {tmp_path / 'sft'}"]


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_the_stage_clock_counts_the_cpu_of_the_processes_a_stage_started():
    """A stage's CPU seconds include a child that worked and exited (reaped) and one still
    running at the stage's end; a stage that only waited has wall time and next to no CPU."""
    import subprocess
    import sys
    import time

    from tmax.training.recipe import StageClock

    with StageClock() as clock:
        with clock.stage("sft_s"):
            subprocess.run([sys.executable, "-c", BURN.format(s=0.6)], check=True)
            running = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6) + "print('done', flush=True)\n"
                                        "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
            assert running.stdout.readline() == "done\n"  # its 0.6 s of work done, now asleep
        with clock.stage("rl_s"):
            time.sleep(0.3)
        running.kill()
        running.wait()
        res = _result()
        clock.finish(res)
    assert res.times.keys() == res.cpu_times.keys() == {"sft_s", "rl_s", "total_s"}
    assert res.cpu_times["sft_s"] >= 1.2, res.cpu_times  # both children's 0.6 s, and their start
    assert res.cpu_times["rl_s"] < 0.2 and res.times["rl_s"] >= 0.3
    # Each figure is rounded to 0.1 s: a sum of two of them can pass the rounded total by that much.
    assert res.cpu_times["total_s"] >= res.cpu_times["sft_s"]
    assert res.times["total_s"] >= res.times["sft_s"] + res.times["rl_s"] - 0.1, res.times


def test_a_stage_where_a_worker_ends_unreaped_by_the_tree_keeps_its_cpu():
    """A grandchild that worked, then lost its parent (SIGKILLed: the grandchild is
    re-parented outside the tree) and ended: nobody in the tree reaps it. Its CPU, seen
    while it lived, stays counted, so no stage comes out negative (the learner and the
    engines end that way inside the recipe's RL stage)."""
    import signal
    import subprocess
    import sys
    import time

    from tmax.common.proctree import TreeCpu

    spawner = ("import subprocess, sys, time\n"
               f"g = subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.6) + 'time.sleep(1.5)'!r}])\n"
               "print(g.pid, flush=True)\ntime.sleep(60)\n")
    tree = TreeCpu(interval_s=0.1)
    try:
        before = tree.read()
        child = subprocess.Popen([sys.executable, "-c", spawner], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        time.sleep(1.0)  # the grandchild's 0.6 s of work done and sampled
        child.send_signal(signal.SIGKILL)
        child.wait()
        while Path(f"/proc/{grandchild}").exists():  # it sleeps out its 1.5 s and exits, reaped by init
            time.sleep(0.1)
        after = tree.read()
    finally:
        tree.close()
    assert after - before >= 0.5, (before, after)
