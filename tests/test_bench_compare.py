"""`tmax bench compare`: the statistics, and an oracle job against a nop job on podman
(whose directories Harbor's own models must also load)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harbor_env import harbor_check
from tasks.compare import bootstrap_ci, mcnemar_exact

TASK = Path(__file__).parent / "data" / "tasks" / "echo-hello"
N_TASKS = 8


def test_mcnemar_exact_matches_the_binomial():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(8, 0) == pytest.approx(2 / 2**8)
    assert mcnemar_exact(3, 3) == 1.0
    # b=1, c=5: 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * 7/64
    assert mcnemar_exact(1, 5) == pytest.approx(14 / 64)


def test_bootstrap_interval_brackets_the_mean():
    values = [1.0] * 6 + [0.0] * 4
    lo, hi = bootstrap_ci(values)
    assert lo < 0.6 < hi and 0.0 <= lo and hi <= 1.0
    assert bootstrap_ci([1.0] * 5) == (1.0, 1.0)


@pytest.fixture(scope="module")
def oracle_and_nop(tmp_path_factory) -> list[Path]:
    """An oracle job and a nop job over the same 8 tasks (real podman trials)."""
    if shutil.which("podman") is None or subprocess.run(
            ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
        pytest.skip("podman or the base image is missing")
    from tasks.job import Job, JobConfig

    tmp_path = tmp_path_factory.mktemp("compare")
    ds = tmp_path / "ds"
    for i in range(N_TASKS):
        shutil.copytree(TASK, ds / f"echo-{i}")
    dirs = []
    for agent in ("oracle", "nop"):
        job = Job(JobConfig(job_name=agent, jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent=agent,
                            n_concurrent=4))
        job.run()
        dirs.append(job.dir)
    return dirs


@pytest.mark.podman
def test_compare_oracle_against_nop(oracle_and_nop):
    from tmax_cli.main import app

    dirs = oracle_and_nop
    res = CliRunner().invoke(app, ["bench", "compare", *map(str, dirs), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    oracle, nop = data["jobs"]
    assert (oracle["pass_at_1"], nop["pass_at_1"]) == (1.0, 0.0)
    assert oracle["n_infra_errors"] == nop["n_infra_errors"] == 0
    (pair,) = data["pairs"]
    assert sorted(pair["a_not_b"]) == [f"echo-{i}" for i in range(N_TASKS)] and pair["b_not_a"] == []
    assert pair["p_value"] < 0.05
    assert Path(data["chart"]).stat().st_size > 0
    table = CliRunner().invoke(app, ["bench", "compare", *map(str, dirs), "--no-chart"])
    assert table.exit_code == 0 and "McNemar" in table.output


@pytest.mark.podman
def test_harbor_models_load_the_job_directories(oracle_and_nop):
    loaded = harbor_check(*oracle_and_nop)
    assert loaded["failures"] == []
    assert (loaded["jobs"], loaded["trials"]) == (2, 2 * N_TASKS)
