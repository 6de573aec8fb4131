"""`tmax bench -e bwrap|local`: generated nano tasks run on the host sandboxes (oracle 1,
nop 0, the tmax agent against a scripted model server), parallel trials keep to their own
workspace and logs, a task that needs podman fails fast as an infrastructure error naming
its Dockerfile line, and the local sandbox's exec merges repeated env keys."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tmax.sandbox import SandboxSpec, make_sandbox
from tmax.tasks.hostenv import HostEnvError, check_dockerfile, prepare
from tmax.tasks.job import VOLATILE, Job, JobSpec, JobError
from tmax.tasks.task_format import Task
from tmax.training.nano.tasks import oracle_commands, write_splits

REPO = Path(__file__).resolve().parents[2]
TMAX = [sys.executable, "-m", "tmax.cli.main"]
TB2_REGEX_LOG = REPO.parent / "shared" / "tb2-sample" / "regex-log"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    """Four held-out nano tasks (the kinds with seed files and without)."""
    root = tmp_path_factory.mktemp("nano")
    write_splits(root, 0, 4, seed=3)
    return root / "heldout"


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """Host workspaces go to a directory of this test's own, so leftovers can be counted."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def trial_results(job_dir: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "result.json").read_text())
            for d in job_dir.iterdir() if d.is_dir() and (d / "result.json").exists()}


def make_task(root: Path, dockerfile: str, files: dict[str, str] | None = None) -> Task:
    """A copy-free task directory with the given Dockerfile and build-context files."""
    root.mkdir(parents=True)
    (root / "task.toml").write_text('version = "1.0"\n')
    (root / "instruction.md").write_text("Do it.\n")
    (root / "environment").mkdir()
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        (root / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "environment" / rel).write_text(text)
    (root / "tests").mkdir()
    (root / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > \"$TMAX_LOGS_DIR/verifier/reward.txt\"\n")
    return Task.load(root)


# --- the Dockerfile check and the workspace ---------------------------------------------

def test_plain_dockerfile_becomes_a_workspace(tmp_path):
    task = make_task(tmp_path / "t", (
        "# comment\nFROM localhost/tmax-base:bookworm\nWORKDIR /srv\nWORKDIR app\n"
        "ENV A=1 B=\"two words\"\nENV LEGACY some value\n"
        "COPY files/ ./\nCOPY one.txt renamed.txt\nADD [\"two.txt\", \"sub/\"]\n"
        "COPY --chown=1000 a.cfg b.cfg conf/\n"), {
        "files/seed.txt": "seed\n", "files/d/x.txt": "x\n", "one.txt": "1\n", "two.txt": "2\n",
        "a.cfg": "a\n", "b.cfg": "b\n"})
    plan = check_dockerfile(task)
    assert plan.workdir == "/srv/app"
    assert plan.env == {"A": "1", "B": "two words", "LEGACY": "some value"}
    env = prepare(task, "local")
    try:
        files = sorted(str(p.relative_to(env.workspace)) for p in env.workspace.rglob("*") if p.is_file())
        assert files == ["conf/a.cfg", "conf/b.cfg", "d/x.txt", "renamed.txt", "seed.txt", "sub/two.txt"]
        assert env.workdir == str(env.workspace)
        assert env.spec(network=False).env["B"] == "two words"
    finally:
        env.close()
    assert not env.root.exists()


@pytest.mark.parametrize("line, why", [
    ("RUN apt-get install -y curl", "RUN changes the image"),
    ("COPY --from=builder /out ./", "another image or stage"),
    ("COPY seed.txt /etc/seed.txt", "outside the WORKDIR /app"),
    ("ADD https://example.com/x.tar.gz ./", "a remote source"),
    ("FROM localhost/tmax-base:bookworm", "multi-stage"),
    ("COPY $SRC ./", "variable substitution"),
])
def test_dockerfiles_that_need_podman_name_their_line(tmp_path, line, why):
    task = make_task(tmp_path / "t", f"FROM localhost/tmax-base:bookworm\nWORKDIR /app\n{line}\n",
                     {"seed.txt": "s\n"})
    with pytest.raises(HostEnvError) as e:
        check_dockerfile(task)
    msg = str(e.value)
    assert "needs podman" in msg and "line 3" in msg and line in msg and why in msg, msg


def test_other_base_images_and_missing_workdir_need_podman(tmp_path):
    with pytest.raises(HostEnvError, match="line 1: `FROM python:3.13-slim`"):
        check_dockerfile(make_task(tmp_path / "a", "FROM python:3.13-slim\nWORKDIR /app\n"))
    with pytest.raises(HostEnvError, match="sets no WORKDIR"):
        check_dockerfile(make_task(tmp_path / "b", "FROM localhost/tmax-base:bookworm\n"))
    with pytest.raises(HostEnvError, match="no file matches missing.txt"):
        prepare(make_task(tmp_path / "c", "FROM localhost/tmax-base:bookworm\nWORKDIR /app\nCOPY missing.txt ./\n"),
                "local")


# --- the local sandbox's exec env ---------------------------------------------------------

def test_local_exec_env_repeated_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("TMAX_TEST_REPEATED", "host")
    sb = make_sandbox("local", SandboxSpec(workdir=str(tmp_path), env={"TMAX_TEST_REPEATED": "spec"}))
    sb.start()
    try:
        show = ["bash", "-c", "echo $TMAX_TEST_REPEATED"]
        assert sb.exec(show, timeout=10).output.strip() == "spec"
        assert sb.exec(show, timeout=10, env={"TMAX_TEST_REPEATED": "call"}).output.strip() == "call"
    finally:
        sb.close()


# --- jobs on the host sandboxes -------------------------------------------------------------

@pytest.mark.parametrize("env", [pytest.param("bwrap", marks=[pytest.mark.bwrap, needs_bwrap]), "local"])
def test_cli_oracle_passes_on_host(nano, tmp_path, env):
    jobs = tmp_path / "jobs"
    r = subprocess.run(TMAX + ["bench", "run", str(nano), "-a", "oracle", "-e", env, "-n", "2", "-l", "3",
                               "-o", str(jobs), "--job-name", "oracle"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    results = trial_results(jobs / "oracle")
    assert len(results) == 3
    for name, res in results.items():
        assert res["tmax"]["outcome"] == "pass" and res["tmax"]["reward"] == 1.0, res["exception_info"]
        assert res["tmax"]["environment"] == env and res["tmax"]["image"] is None
        assert "PASS" in (jobs / "oracle" / name / "verifier" / "test-stdout.txt").read_text()
        assert (jobs / "oracle" / name / "agent" / "oracle.txt").is_file()
    cfg = json.loads((jobs / "oracle" / "config.json").read_text())
    # Harbor's environment types have no host sandboxes: they are named by import path.
    assert cfg["tmax_job"]["environment"] == env and cfg["environment"]["import_path"] == f"tmax.sandbox.{env}"
    assert not list(tmp_path.glob("tmax-hostenv-*"))  # workspaces removed


@pytest.mark.bwrap
@needs_bwrap
def test_nop_scores_zero_and_parallel_trials_keep_apart(nano, tmp_path, private_tmp):
    jobs = tmp_path / "jobs"
    job = Job(JobSpec(job_name="nop", jobs_dir=str(jobs), dataset=str(nano), agent="nop", environment="bwrap",
                        n_concurrent=4))
    assert job.run().tmax_score["mean_reward"] == 0.0
    # Four oracle trials at once: each passes on its own workspace and logs dir, which
    # would not hold if they shared one (the tasks write different answers).
    job = Job(JobSpec(job_name="par", jobs_dir=str(jobs), dataset=str(nano), agent="oracle", environment="bwrap",
                        n_concurrent=4, n_attempts=2))
    data = job.run()
    results = trial_results(job.dir)
    assert len(results) == 8 and data.tmax_score["mean_reward"] == 1.0
    rewards = {n: (job.dir / n / "verifier" / "reward.txt").read_text().strip() for n in results}
    assert set(rewards.values()) == {"1"}
    assert not list(private_tmp.glob("tmax-hostenv-*"))


@pytest.mark.bwrap
@needs_bwrap
def test_tmax_agent_with_scripted_server_on_bwrap(nano, tmp_path, private_tmp):
    from scripted_server import ScriptedServer

    task_dir = sorted(nano.iterdir())[0]
    *solve, submit = oracle_commands(task_dir)
    turns = [{"bash": f"cd /app && pwd && {' && '.join(solve)}"}, {"bash": submit}]
    with ScriptedServer(turns) as srv:
        job = Job(JobSpec(job_name="scripted", jobs_dir=str(tmp_path / "jobs"), dataset=str(task_dir),
                            agent="tmax", model=srv.model, base_url=srv.base_url, environment="bwrap"))
        job.run()
        assert len(srv.requests) == 2
    (r,) = trial_results(job.dir).values()
    assert r["tmax"]["outcome"] == "pass" and r["tmax"]["reward"] == 1.0, r["exception_info"]
    assert r["agent_result"]["metadata"]["status"] == "submitted"
    agent_dir = job.dir / r["trial_name"] / "agent"
    traj = json.loads((agent_dir / "messages.json").read_text())  # as sent; trajectory.json is ATIF
    assert any("/app" in str(m.get("content")) for m in traj if m["role"] == "tool")
    assert json.loads((agent_dir / "trajectory.json").read_text())["schema_version"] == "ATIF-v1.6"


@pytest.mark.bwrap
@needs_bwrap
def test_tb2_task_needs_podman_is_an_infra_error(tmp_path, private_tmp):
    if not TB2_REGEX_LOG.is_dir():
        pytest.skip("the TB2 sample is not here")
    job = Job(JobSpec(job_name="tb2", jobs_dir=str(tmp_path / "jobs"), dataset=str(TB2_REGEX_LOG),
                        agent="oracle", environment="bwrap"))
    data = job.run()
    (r,) = trial_results(job.dir).values()
    assert r["tmax"]["outcome"] == "infra_error" and r["tmax"]["reward"] is None
    exc = r["exception_info"]
    assert exc["exception_type"] == "HostEnvError"
    assert "regex-log needs podman" in exc["exception_message"] and "FROM ubuntu:24.04" in exc["exception_message"]
    assert data.tmax_score["n_infra_errors"] == 1
    assert not (job.dir / r["trial_name"] / "agent").exists()  # failed before any agent ran


def test_verifier_timeout_on_host(tmp_path, private_tmp):
    task = make_task(tmp_path / "slow", "FROM localhost/tmax-base:bookworm\nWORKDIR /app\n")
    (task.path / "tests" / "test.sh").write_text("sleep 30\n")
    toml = "[verifier]\ntimeout_sec = 1.0\n"
    (task.path / "task.toml").write_text('version = "1.0"\n' + toml)
    job = Job(JobSpec(job_name="slow", jobs_dir=str(tmp_path / "jobs"), dataset=str(task.path), agent="nop",
                        environment="local"))
    job.run()
    (r,) = trial_results(job.dir).values()
    assert r["tmax"]["outcome"] == "verifier_error"
    assert r["exception_info"]["exception_type"] == "VerifierTimeoutError"


@pytest.mark.parametrize("test_sh,verifier_status,exception_type", [
    ("exit 3\n", "no_reward", "RewardFileNotFoundError"),
    (': > "$TMAX_LOGS_DIR/verifier/reward.txt"\n', "empty_reward", "RewardFileEmptyError"),
    ('echo yes > "$TMAX_LOGS_DIR/verifier/reward.txt"\n', "parse_error", "VerifierOutputParseError"),
    ("exit 97\n", "setup_failed", "VerifierError"),
])
def test_verifier_without_reward_is_typed(tmp_path, private_tmp, test_sh, verifier_status, exception_type):
    """Each way a verifier gives no reward reaches result.json as its own kind and Harbor
    exception type, mapped from the verifier's result kind rather than its message."""
    task = make_task(tmp_path / "t", "FROM localhost/tmax-base:bookworm\nWORKDIR /app\n")
    (task.path / "tests" / "test.sh").write_text(test_sh)
    job = Job(JobSpec(job_name="v", jobs_dir=str(tmp_path / "jobs"), dataset=str(task.path), agent="nop",
                        environment="local"))
    job.run()
    (r,) = trial_results(job.dir).values()
    assert r["tmax"]["outcome"] == "verifier_error" and r["tmax"]["reward"] is None
    assert r["tmax"]["verifier_status"] == verifier_status
    assert r["exception_info"]["exception_type"] == exception_type


def test_environment_is_part_of_the_identity(nano, tmp_path):
    base = dict(job_name="ident", jobs_dir=str(tmp_path / "jobs"), dataset=str(nano), agent="nop")
    podman, bwrap = JobSpec(**base), JobSpec(**base, environment="bwrap")
    sums = {"t": "x"}
    assert podman.identity(sums) != bwrap.identity(sums)
    # Podman jobs keep the identity they had before the field existed (their trial names).
    old = {k: v for k, v in podman.model_dump().items() if k not in VOLATILE and k != "environment"}
    old.update(dataset=None, tasks=sums)
    assert podman.identity(sums) == hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()
    with pytest.raises(ValueError, match="unknown environment 'docker'"):
        JobSpec(**base, environment="docker")
    with pytest.raises(JobError, match="contradicts JobSpec.environment"):
        Job(bwrap, sandbox_kind="podman")


def test_resume_keeps_the_environment(nano, tmp_path, private_tmp):
    jobs = tmp_path / "jobs"
    job = Job(JobSpec(job_name="res", jobs_dir=str(jobs), dataset=str(nano), agent="nop", environment="local",
                        limit=1))
    job.run()
    again = Job.open(jobs / "res")
    assert again.config.environment == "local" and again.identity == job.identity
    assert again.pending() == ([], 1)
    with pytest.raises(JobError, match="runs its trials with -e local, not podman"):
        Job.open(jobs / "res", environment="podman")
    r = subprocess.run(TMAX + ["bench", "resume", str(jobs / "res"), "-e", "bwrap"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "not bwrap" in r.stdout + r.stderr
