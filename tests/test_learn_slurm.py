"""`tmax learn --nodes 1` submitted to a real Slurm through the sbatch script that
`--dry-run` prints: Slurm runs the batch step, `tmax learn` sees the allocation, starts the
Ray head inside it (`ray start --head`, not a local in-process cluster), completes a DPPO
step and stops Ray again.

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

from tests.test_learn_multinode import _config

REPO = Path(__file__).resolve().parents[1]
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


def _sbatch_script(cfg: Path, run: Path, env: dict[str, str]) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "tmax_cli.main", "learn", "--nodes", "1", "--gpus-per-node", "0", "--dry-run",
         "--config", str(cfg), "--out", str(run), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split("----\n", 1)[1]


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


@pytest.mark.timeout(900)
def test_learn_step_through_sbatch(tmp_path, slurm_env):
    pytest.importorskip("vllm")
    cfg = _config(tmp_path)
    cfg.write_text(cfg.read_text().replace("steps = 2", "steps = 1").replace("rollout_workers = 2", "rollout_workers = 1").replace("concurrency = 8", "concurrency = 4"))
    run = tmp_path / "run"
    script = tmp_path / "tmax-learn.sbatch"
    script.write_text(_sbatch_script(cfg, run, slurm_env))
    assert "#SBATCH --nodes=1" in script.read_text()

    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], env=slurm_env,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    _wait_for_job(job_id, slurm_env, timeout_s=780)

    log = (tmp_path / f"tmax-learn-{job_id}.out").read_text()
    assert "tmax: nodes " in log, log[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    assert [r["step"] for r in rows] == [1], log[-6000:]
    assert rows[0]["learner/tokens"] > 0
    # Ray came from the allocation: the head tmax started inside the job, not an in-process cluster.
    assert "ray cluster: slurm" in log, log[-4000:]
