"""`tmax learn --nodes 1` submitted to a real Slurm through the sbatch script that
`--dry-run` writes: Slurm runs the batch step, `tmax learn --config` (the whole run, as the
dry run was asked: the default config sized small by `TMAX_LEARN_*` settings, one step,
`--env bwrap --image-map A=B`) sees the allocation, starts the Ray head inside it
(`ray start --head`, not a local in-process cluster), builds, SFTs, completes a DPPO step
with every episode in bwrap, and stops its own Ray head again, leaving another cluster on
the machine (the session's shared one) running.

The cluster is a single-machine Slurm (munge + slurmctld + slurmd) that
`scripts/slurm-local.sh` installs and starts; the test skips only where it cannot start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_learn_cli import SMALL_NANO
from tmax.training.cluster.launch import DEFAULT_PORT
from tmax.training.config import load_config

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "scripts" / "slurm-local.sh"

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.slurm]


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    if os.geteuid() != 0 or shutil.which("apt-get") is None and shutil.which("slurmd") is None:
        pytest.skip("a local Slurm needs root and Debian's slurm-wlm")
    r = subprocess.run(["bash", str(SLURM), "start"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"Slurm could not start here: {(r.stdout + r.stderr).strip()[-800:]}")
    env = dict(os.environ)
    env["SLURM_CONF"] = os.environ.get("TMAX_SLURM_DIR", "/var/tmp/tmax-slurm") + "/slurm.conf"
    # The batch step runs `tmax learn`: the venv's entry point first on PATH, this checkout importable.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    for k in ("RAY_ADDRESS", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        env.pop(k, None)
    return env


def _sbatch_script(run: Path, env: dict[str, str]) -> Path:
    r = subprocess.run(
        [sys.executable, "-m", "tmax.cli.main", "learn", "--nodes", "1", "--gpus-per-node", "0", "--steps", "1",
         "--env", "bwrap", "--image-map", "A=B", "--dry-run", "--out", str(run)],
        env=env | SMALL_NANO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return run / "tmax-learn.sbatch"


def _wait_for_job(job_id: str, env: dict[str, str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(3)
    else:
        subprocess.run(["scancel", job_id], env=env)
        pytest.fail(f"Slurm job {job_id} still running after {timeout_s:g}s")
    acct = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True)
    return acct.stdout


def _gcs_servers_on(port: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == "gcs_server" and f"--gcs_server_port={port}" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.timeout(900)
def test_learn_step_through_sbatch(tmp_path, slurm_env, ray_head):
    pytest.importorskip("vllm")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    if not ray_head.alive():
        ray_head.start()
    run = tmp_path / "run"
    script = _sbatch_script(run, slurm_env)
    assert "#SBATCH --nodes=1" in script.read_text()

    # Submitted from a shell without the TMAX_LEARN_* settings: the config file carries them.
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], env=slurm_env,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    _wait_for_job(job_id, slurm_env, timeout_s=780)

    log = (tmp_path / f"tmax-learn-{job_id}.out").read_text()
    assert "tmax: nodes " in log, log[-4000:]
    rl = run / "rl"
    rows = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()] if (rl / "metrics.jsonl").exists() else []
    assert [r["step"] for r in rows] == [1], log[-6000:]
    assert rows[0]["learner/tokens"] > 0
    # Ray came from the allocation: the head tmax started inside the job, not an in-process cluster.
    assert "ray cluster: slurm" in log, log[-4000:]
    # The run was the one asked for: its episodes in bwrap, with the image map and the sizes.
    rollouts = [json.loads(x) for x in (rl / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and {r["sandbox"] for r in rollouts} == {"bwrap"}
    ran = load_config(rl / "config.toml")
    assert (ran.rollout.sandbox, ran.eval.sandbox, ran.rollout.image_map) == ("bwrap", "bwrap", ["A=B"])
    assert (ran.tasks.n_train, ran.algo.steps, ran.cluster.nodes) == (4, 1, 1)
    # The job stopped the head it started (on Ray's default port) and nothing else: the
    # session's cluster, on the same machine, still runs.
    assert _gcs_servers_on(DEFAULT_PORT) == []
    assert ray_head.alive()
