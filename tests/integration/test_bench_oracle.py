"""Real Terminal-Bench 2.0 tasks, offline: the oracle scores 1 and nop scores 0.

By default a light subset of the sample runs (CI: six tasks for the oracle, three of them for
nop); TMAX_BENCH_FULL_SAMPLE=1 runs every sample task with both, except those listed, with
the reason, in tasks/data/offline_infeasible.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tmax.tasks.job import Job, JobSpec
from tmax.tasks.offline import DATA_DIR

pytestmark = [pytest.mark.podman, pytest.mark.slow]

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "tb2-sample"
# Light tasks: small images, no downloads in the oracle, short verifiers; both base kinds.
# (cancel-async-tasks is left out: its tests send SIGINT 0.5 s after starting Python and
# fail on a loaded machine.)
LIGHT = ["regex-log", "polyglot-c-py", "sqlite-db-truncate", "llm-inference-batching-scheduler",
         "openssl-selfsigned-cert", "constraints-scheduling"]
# nop, on three of them (both base kinds, the shortest verifiers): that an unsolved task
# scores 0 and not an infrastructure error is the harness's part; that each task's tests
# catch an untouched environment is the task's, which the full sample checks.
NOP_LIGHT = ["polyglot-c-py", "sqlite-db-truncate", "openssl-selfsigned-cert"]

if not SAMPLE.is_dir() or shutil.which("podman") is None or subprocess.run(
        ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
    pytest.skip("needs ../shared/tb2-sample, podman and the base image", allow_module_level=True)


def infeasible() -> dict[str, str]:
    data = tomllib.loads((DATA_DIR / "offline_infeasible.toml").read_text())
    return {t["name"]: t["why"] for t in data.get("task", [])}


def selected(agent: str) -> list[str]:
    if os.environ.get("TMAX_BENCH_FULL_SAMPLE") == "1":
        names = sorted(d.name for d in SAMPLE.iterdir() if (d / "task.toml").is_file())
    else:
        names = NOP_LIGHT if agent == "nop" else LIGHT
    return [n for n in names if n not in infeasible()]


def test_light_subset_is_feasible():
    assert len(LIGHT) >= 6 and not set(LIGHT) & set(infeasible()) and set(NOP_LIGHT) < set(LIGHT)


@pytest.mark.parametrize("agent,reward", [("oracle", 1.0), ("nop", 0.0)])
def test_sample_tasks(tmp_path, agent, reward):
    names = selected(agent)
    # Every task at once by default: the verifiers wait on package downloads as much as on
    # the CPU (the oracle's six took 114 s three at a time, 62 s all at once, the CPU then busy).
    n = int(os.environ.get("TMAX_BENCH_N", len(names)))
    job = Job(JobSpec(job_name=f"{agent}-sample", jobs_dir=str(tmp_path), dataset=str(SAMPLE), include=names,
                        agent=agent, n_concurrent=n))
    data = job.run()
    sc = data.tmax_score
    rows = {r["task"]: r for r in sc["tasks"]}
    assert sorted(rows) == sorted(names)
    wrong = {t: r["outcomes"] for t, r in rows.items() if r["mean_reward"] != reward}
    assert not wrong, f"{agent} expected reward {reward}: {wrong}"
    assert sc["n_infra_errors"] == 0
    left = subprocess.run(["podman", "ps", "-a", "--filter", f"label=io.tmax.job={agent}-sample", "-q"],
                          capture_output=True, text=True).stdout.split()
    assert left == []
