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
from tmax.tasks.compare import mcnemar_exact
from tmax.tasks.scoring import BOOTSTRAP, EXACT, WILSON, clopper_pearson, rate_interval, wilson

TASK = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"
N_TASKS = 8


def test_mcnemar_exact_matches_the_binomial():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(8, 0) == pytest.approx(2 / 2**8)
    assert mcnemar_exact(3, 3) == 1.0
    # b=1, c=5: 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * 7/64
    assert mcnemar_exact(1, 5) == pytest.approx(14 / 64)


def test_few_tasks_get_an_exact_interval():
    # 6 of 6 solved: a bootstrap over six tasks says [100 %, 100 %]; the exact interval does not.
    (lo, hi), method = rate_interval([(1, 1)] * 6)
    assert method == EXACT and lo == pytest.approx(0.025 ** (1 / 6), abs=1e-6) and hi == 1.0
    assert clopper_pearson(3, 10) == pytest.approx((0.0667395, 0.6524529), abs=1e-6)  # the textbook values
    assert clopper_pearson(0, 6)[0] == 0.0
    # Several attempts per task make a task's rate a fraction: Wilson's interval over tasks.
    (lo, hi), method = rate_interval([(5, 3)] * 6)
    assert method == WILSON and (lo, hi) == pytest.approx(wilson(0.6, 6)) and lo < 0.6 < hi
    # pass@5 of those tasks is 1 for each: back to 0/1 outcomes, exact again.
    assert rate_interval([(5, 3)] * 6, k=5)[1] == EXACT


def test_many_tasks_get_a_nested_bootstrap():
    per_task = [(5, 5)] * 20 + [(5, 0)] * 20 + [(5, 2)] * 10
    (lo, hi), method = rate_interval(per_task)
    mean = (20 + 10 * 0.4) / 50
    assert method == BOOTSTRAP and lo < mean < hi and 0.0 <= lo and hi <= 1.0
    # Attempts are resampled inside a task: tasks that are all 2-of-5 still vary.
    (lo, hi), _ = rate_interval([(5, 2)] * 40)
    assert lo < 0.4 < hi


@pytest.fixture(scope="module")
def oracle_and_nop(tmp_path_factory) -> list[Path]:
    """An oracle job and a nop job over the same 8 tasks (real podman trials)."""
    if shutil.which("podman") is None or subprocess.run(
            ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
        pytest.skip("podman or the base image is missing")
    from tmax.tasks.job import Job, JobSpec

    tmp_path = tmp_path_factory.mktemp("compare")
    ds = tmp_path / "ds"
    for i in range(N_TASKS):
        shutil.copytree(TASK, ds / f"echo-{i}")
    dirs = []
    for agent in ("oracle", "nop"):
        job = Job(JobSpec(job_name=agent, jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent=agent,
                            n_concurrent=4))
        job.run()
        dirs.append(job.dir)
    return dirs


@pytest.mark.podman
def test_compare_oracle_against_nop(oracle_and_nop):
    from tmax.cli.main import app

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
    """Harbor's JobResult finds tmax's scores under stats.evals, keyed as Harbor keys them, and
    `harbor view`'s API answers 200 for every job, config, trial and trajectory."""
    loaded = harbor_check(*oracle_and_nop)
    assert loaded["failures"] == []
    assert (loaded["jobs"], loaded["trials"]) == (2, 2 * N_TASKS)
    for job, mean in (("oracle", 1.0), ("nop", 0.0)):
        (evals,) = loaded["evals"][job].values()
        assert evals["metrics"] == [{"mean": mean}] and evals["pass_at_k"] == {"1": mean}
        assert evals["n_trials"] == N_TASKS
        assert loaded["tokens"][job] == [0, 0]
    assert set(loaded["evals"]["oracle"]) == {"oracle__ds"}  # agent__source, the dataset dir's name
    assert len(loaded["viewer"]) == 1 + 2 * (3 + 2 * N_TASKS)
