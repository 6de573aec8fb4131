"""Jobs on real podman containers: concurrency leaves nothing behind, a killed or
interrupted job resumes without duplicated or lost trials, the tmax agent runs against a
scripted model server, agent timeouts are labelled and still verified."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tmax.tasks.job import Job, JobSpec, JobError

pytestmark = [pytest.mark.podman]

REPO = Path(__file__).resolve().parents[2]
GOOD = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"
TMAX = [sys.executable, "-m", "tmax.cli.main"]


def _podman_ok() -> bool:
    return shutil.which("podman") is not None and subprocess.run(
        ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode == 0


if not _podman_ok():
    pytest.skip("podman or the base image is missing", allow_module_level=True)


def dataset(tmp_path: Path, n: int, agent_timeout: float | None = None, solve_s: float = 0) -> Path:
    """`n` copies of echo-hello; `solve_s`: its oracle sleeps that long first."""
    root = tmp_path / "ds"
    for i in range(n):
        d = root / f"echo-{i}"
        shutil.copytree(GOOD, d)
        if agent_timeout:
            toml = (d / "task.toml").read_text().replace("[agent]\ntimeout_sec = 120.0", f"[agent]\ntimeout_sec = {agent_timeout}")
            (d / "task.toml").write_text(toml)
        if solve_s:
            solve = d / "solution" / "solve.sh"
            solve.write_text(solve.read_text().replace("#!/bin/bash\n", f"#!/bin/bash\nsleep {solve_s}\n", 1))
    return root


def containers(job_name: str) -> list[str]:
    r = subprocess.run(["podman", "ps", "-a", "--filter", f"label=io.tmax.job={job_name}", "--format", "{{.Names}}"],
                       capture_output=True, text=True, check=True)
    return r.stdout.split()


def remove_containers(job_name: str) -> None:
    for name in containers(job_name):
        subprocess.run(["podman", "rm", "-f", name], capture_output=True)


def trial_results(job_dir: Path) -> dict[str, dict]:
    out = {}
    for d in job_dir.iterdir():
        if d.is_dir() and not d.name.startswith(".") and (d / "result.json").exists():
            out[d.name] = json.loads((d / "result.json").read_text())
    return out


def test_concurrent_oracle_and_nop_leave_no_container(tmp_path):
    ds = dataset(tmp_path, 4)
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        name = f"conc-{agent}-{os.getpid()}"
        job = Job(JobSpec(job_name=name, jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent=agent,
                            n_attempts=2, n_concurrent=4))
        running_cis = []
        data = job.run(lambda kind, prog, r: kind == "trial_end" and running_cis.append(
            json.loads((job.dir / "result.json").read_text())["tmax_score"]["pass_at_1_ci"]))
        results = trial_results(job.dir)
        assert len(results) == 8
        # Rescored after every trial, the interval only at the end (a bootstrap is not cheap).
        lo, hi = data.tmax_score["pass_at_1_ci"]
        assert running_cis == [None] * 8 and lo <= reward <= hi and lo < hi
        assert data.tmax_score["ci_method"] == "exact Clopper-Pearson"
        assert {r["tmax"]["reward"] for r in results.values()} == {reward}
        assert data.stats.n_completed_trials == 8 and data.stats.n_pending_trials == 0
        assert data.tmax_score["mean_reward"] == reward
        for tdir in results:
            for f in ("config.json", "result.json", "verifier/reward.txt", "verifier/test-stdout.txt"):
                assert (job.dir / tdir / f).is_file(), (tdir, f)
        assert containers(name) == []


def test_trials_take_containers_started_ahead(tmp_path):
    ds = dataset(tmp_path, 3)
    name = f"warm-{os.getpid()}"
    job = Job(JobSpec(job_name=name, jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent="oracle",
                        n_attempts=2, n_concurrent=2, warm_ahead=2))
    data = job.run()
    results = trial_results(job.dir)
    assert len(results) == 6 and {r["tmax"]["outcome"] for r in results.values()} == {"pass"}
    assert data.stats.n_completed_trials == 6
    pool = job._pool
    # The first two trials start their own; a trial after them takes the container started
    # for it, unless the pool had no room then (containers being removed still hold theirs).
    assert pool.warm_hits >= 2 and pool.warm_hits + pool.cold_starts == 6, (pool.warm_hits, pool.cold_starts)
    assert containers(name) == []


def test_identity_ignores_endpoint_and_refuses_a_changed_job(tmp_path):
    ds = dataset(tmp_path, 1)
    base = dict(job_name="ident", jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent="nop")
    a = Job(JobSpec(**base, base_url="http://localhost:8000/v1", n_concurrent=1))
    b = Job(JobSpec(**base, base_url="http://127.0.0.1:9999/v1", n_concurrent=8))
    assert a.identity == b.identity and [p.trial_name for p in a.plans()] == [p.trial_name for p in b.plans()]
    a.run()
    with pytest.raises(JobError, match="different configuration"):
        Job(JobSpec(**{**base, "agent": "oracle"})).run()


def _run_cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(TMAX + args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def _wait_results(job_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_dir.is_dir() and len(trial_results(job_dir)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"job exited early: {proc.stdout.read()}")
        time.sleep(0.5)
    raise AssertionError("no trial finished in time")


@pytest.mark.parametrize("sig,warm", [(signal.SIGKILL, 0), (signal.SIGINT, 0), (signal.SIGINT, 2)])
def test_killed_job_resumes_without_duplicates(tmp_path, sig, warm):
    # Each trial takes over a second, so the kill lands with trials still to run (overlay
    # trials of the bare oracle took a few hundred ms: a job could end between two polls).
    ds = dataset(tmp_path, 3, solve_s=1.5)
    jobs = tmp_path / "jobs"
    name = f"kill-{sig.name.lower()}-{warm}-{os.getpid()}"
    args = ["bench", "run", str(ds), "-a", "oracle", "-k", "2", "-n", "1", "-o", str(jobs), "--job-name", name,
            "--warm-ahead", str(warm)]
    proc = _run_cli(args)
    try:
        _wait_results(jobs / name, 2, proc)
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    everything = trial_results(jobs / name)
    cancelled = [r for r in everything.values() if r["tmax"]["outcome"] == "cancelled"]
    before = {t: r for t, r in everything.items() if r["tmax"]["outcome"] != "cancelled"}
    assert 2 <= len(before) < 6
    assert all(r["exception_info"]["exception_type"] == "CancelledError" for r in cancelled)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "tmax bench resume" in out
        assert containers(name) == []  # Ctrl-C removes the running trial's container (and those started ahead)
    remove_containers(name)  # SIGKILL leaves one behind: that is what `tmax sandbox clean` is for
    r = subprocess.run(TMAX + ["bench", "resume", str(jobs / name)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    after = trial_results(jobs / name)
    assert len(after) == 6
    assert {t: r["id"] for t, r in after.items() if t in before} == {t: r["id"] for t, r in before.items()}
    assert all(r["tmax"]["outcome"] == "pass" for r in after.values())
    assert sorted((r["task_name"], r["tmax"]["attempt"]) for r in after.values()) == \
        sorted((f"echo-{i}", a) for i in range(3) for a in range(2))
    assert containers(name) == []


def test_tmax_agent_with_scripted_server(tmp_path):
    from scripted_server import ScriptedServer

    ds = dataset(tmp_path, 1)
    turns = [{"bash": "cd /app && echo hello > hello.txt && cat hello.txt"},
             {"bash": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]
    with ScriptedServer(turns) as srv:
        job = Job(JobSpec(job_name="scripted", jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent="tmax",
                            model=srv.model, base_url=srv.base_url))
        job.run()
        assert len(srv.requests) == 2
        assert "/app/hello.txt" in json.dumps(srv.requests[0]["messages"])
    (r,) = trial_results(job.dir).values()
    assert r["tmax"]["outcome"] == "pass" and r["tmax"]["reward"] == 1.0
    assert r["agent_result"]["metadata"]["status"] == "submitted"
    agent_dir = job.dir / r["trial_name"] / "agent"
    traj = json.loads((agent_dir / "messages.json").read_text())  # as sent; trajectory.json is ATIF
    assert any("hello" in str(m.get("content")) for m in traj if m["role"] == "tool")
    assert json.loads((agent_dir / "trajectory.json").read_text())["schema_version"] == "ATIF-v1.6"


def test_agent_timeout_is_labelled_and_still_verified(tmp_path):
    from scripted_server import ScriptedServer

    ds = dataset(tmp_path, 1, agent_timeout=4)
    turns = [{"bash": "echo hello > /app/hello.txt; sleep 60"}, {"bash": "echo never"}]
    with ScriptedServer(turns) as srv:
        job = Job(JobSpec(job_name="timeout", jobs_dir=str(tmp_path / "jobs"), dataset=str(ds), agent="tmax",
                            model=srv.model, base_url=srv.base_url))
        t0 = time.monotonic()
        job.run()
        assert time.monotonic() - t0 < 60
    (r,) = trial_results(job.dir).values()
    assert r["tmax"]["outcome"] == "agent_timeout"
    assert r["exception_info"]["exception_type"] == "AgentTimeoutError"
    assert r["tmax"]["reward"] == 1.0  # the file was written before the timeout; the verifier ran
    assert containers("timeout") == []


def test_bench_run_config_file_with_flags_on_top(tmp_path):
    """`tmax bench run --config FILE`: the job's settings and the agent's from a TOML file,
    the flags given on the command line over them, against a scripted model."""
    from scripted_server import ScriptedServer

    ds = dataset(tmp_path, 2)
    jobs = tmp_path / "jobs"
    turns = [{"bash": "cd /app && echo hello > hello.txt && cat hello.txt"},
             {"bash": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]
    with ScriptedServer(turns) as srv:
        config = tmp_path / "bench.toml"
        config.write_text(f'dataset = "{ds}"\nagent = "tmax"\nmodel = "{srv.model}"\nn_attempts = 3\n'
                          f'include = ["echo-1"]\njobs_dir = "{jobs}"\njob_name = "from-file"\n'
                          "max_steps = 5\ntemperature = 0.25\ntop_p = 0.5\n")
        r = subprocess.run(TMAX + ["bench", "run", "--config", str(config), "-k", "1", "--base-url", srv.base_url,
                                   "--ak", "temperature=0.5"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert [(q["temperature"], q["top_p"]) for q in srv.requests] == [(0.5, 0.5)] * 2
    job = json.loads((jobs / "from-file" / "config.json").read_text())["tmax_job"]
    assert (job["n_attempts"], job["include"], job["agent"], job["model"]) == (1, ["echo-1"], "tmax", srv.model)
    assert job["agent_kwargs"] == {"max_steps": 5, "temperature": 0.5, "top_p": 0.5}
    (result,) = trial_results(jobs / "from-file").values()
    assert result["task_name"] == "echo-1" and result["tmax"]["outcome"] == "pass"
    assert containers("from-file") == []
    # A mistake in the file is one line naming it, before any trial.
    config.write_text('dataset = "ds"\nmax_stepz = 5\n')
    r = subprocess.run(TMAX + ["bench", "run", "-c", str(config)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{config}: unknown key(s) 'max_stepz'" in r.stderr.replace("\n", " ")
