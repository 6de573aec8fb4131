"""`tmax data validate` and `tmax data solve` on a hand-made corpus with one known defect
per task (bwrap host sandbox), and the gates on real podman images."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmax.sandbox.base_image import image_exists
from tmax.tasks.task_images import BASE_TAG
from tmax.cli.main import app

DATA = Path(__file__).parents[1] / "data" / "corpus" / "validate"
runner = CliRunner()
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

EXPECTED = {
    "good": ("ok", []),
    "no-solution": ("unverified", ["oracle"]),
    "missing-test-sh": ("rejected", ["load"]),
    "bad-toml": ("rejected", ["load"]),
    "nop-passes": ("rejected", ["nop"]),
    "wrong-solution": ("rejected", ["oracle"]),
    "needs-podman": ("rejected", ["build"]),
    "initial-fails": ("rejected", ["initial"]),
}


def copy_corpus(tmp_path: Path, names: list[str]) -> Path:
    root = tmp_path / "corpus"
    for n in names:
        shutil.copytree(DATA / n, root / n)
    return root


@pytest.mark.bwrap
@needs_bwrap
def test_validate_names_each_defect(tmp_path):
    root = copy_corpus(tmp_path, list(EXPECTED))
    r = runner.invoke(app, ["data", "validate", str(root), "-e", "bwrap", "-n", "4", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    got = {t["task"]: (t["verdict"], t["failed"]) for t in data["tasks"]}
    assert got == EXPECTED
    assert set(data["tasks"][0]) == {"task", "verdict", "failed", "reasons"}
    reasons = {t["task"]: t["reasons"] for t in data["tasks"]}
    assert "test.sh" in reasons["missing-test-sh"]["load"]
    assert "invalid TOML" in reasons["bad-toml"]["load"]
    assert "untouched environment" in reasons["nop-passes"]["nop"]
    assert "no solution" in reasons["no-solution"]["oracle"]
    assert "RUN" in reasons["needs-podman"]["build"]
    assert "numbers.txt" in reasons["initial-fails"]["initial"]
    assert data["counts"]["ok"] == 1 and data["counts"]["rejected"] == 6 and data["counts"]["unverified"] == 1
    assert data["counts"]["failed_by_gate"]["load"] == 2
    # every gate is recorded per task next to its trials
    gates = json.loads((root / ".tmax-validate" / "good" / "gates.json").read_text())["gates"]
    assert gates == {"load": "ok", "build": "ok", "initial": "ok", "nop": "ok", "oracle": "ok"}


@pytest.mark.bwrap
@needs_bwrap
def test_solve_pass_at_k_and_band(tmp_path):
    root = copy_corpus(tmp_path, ["good", "wrong-solution"])
    out = tmp_path / "band"
    r = runner.invoke(app, ["data", "solve", str(root), "-a", "oracle", "-k", "2", "-e", "bwrap",
                            "--band", "0.5:1", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["tasks"]["good"]["pass_at_k"] == {"1": 1.0, "2": 1.0}
    assert data["tasks"]["wrong-solution"]["pass_at_k"] == {"1": 0.0, "2": 0.0}
    assert data["band"] == ["good"] and [p.name for p in out.iterdir()] == ["good"]
    summary = json.loads((root / ".tmax-solve" / "oracle" / "good.json").read_text())
    assert summary["num_runs"] == 2 and summary["num_success"] == 2
    rep = runner.invoke(app, ["data", "report", str(root), "--json"])
    assert json.loads(rep.stdout)["success_rate"]["oracle"]["counts"][9] == 1
    # each task is a scheduler job: a rerun reads both back and runs no trial
    trials = sorted((root / ".tmax-solve" / "jobs").rglob("result.json"))
    stamps = [t.stat().st_mtime_ns for t in trials]
    r = runner.invoke(app, ["data", "solve", str(root), "-a", "oracle", "-k", "2", "-e", "bwrap", "--jsonl"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert {x["task"]: x["resumed"] for x in lines if "task" in x} == {"good": True, "wrong-solution": True}
    assert [t.stat().st_mtime_ns for t in trials] == stamps


@pytest.mark.podman
@pytest.mark.skipif(shutil.which("podman") is None or not image_exists(BASE_TAG), reason="needs podman and the base image")
def test_gates_on_podman(tmp_path):
    root = copy_corpus(tmp_path, ["good", "wrong-solution"])
    (root / "good" / "tests" / "test_initial_state.py").unlink()  # the base image has no python3
    shutil.copytree(DATA / "good", root / "broken-build")
    (root / "broken-build" / "environment" / "Dockerfile").write_text(
        f"FROM {BASE_TAG}\nRUN echo setup failed >&2; exit 3\n")
    # The same image as `good`, whose agent user it never created: the task's defect.
    shutil.copytree(root / "good", root / "no-agent-user")
    with open(root / "no-agent-user" / "task.toml", "a") as f:
        f.write('user = "user"\n')  # the last table of the file is [agent]
    # A mirror that does not answer: transient, retried, then an infrastructure error (not judged).
    shutil.copytree(DATA / "good", root / "mirror-down")
    (root / "mirror-down" / "environment" / "Dockerfile").write_text(
        f"FROM {BASE_TAG}\nRUN echo \"E: Failed to fetch http://deb.debian.org/debian/pool/x.deb  Temporary failure "
        "resolving 'deb.debian.org'\" >&2; exit 100\n")
    r = runner.invoke(app, ["data", "validate", str(root), "-e", "podman", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    got = {t["task"]: (t["verdict"], t["failed"]) for t in json.loads(r.stdout)["tasks"]}
    assert got == {"good": ("ok", []), "wrong-solution": ("rejected", ["oracle"]),
                   "broken-build": ("rejected", ["build"]), "no-agent-user": ("rejected", ["build"]),
                   "mirror-down": ("infra_error", ["build"])}
    assert json.loads(r.stdout)["counts"]["infra_error"] == 1
    reasons = {t["task"]: t["reasons"] for t in json.loads(r.stdout)["tasks"]}
    assert "setup failed" in reasons["broken-build"]["build"]
    assert "a step of its Dockerfile failed" in reasons["broken-build"]["build"]
    assert reasons["mirror-down"]["build"].startswith("infrastructure error: ")
    assert "a mirror or registry did not answer" in reasons["mirror-down"]["build"]
    log = reasons["mirror-down"]["build"].split("(build log: ")[1].rstrip(")")
    assert Path(log).read_text().count("$ podman") == 3  # tried three times
    assert "[agent] user = 'user'" in reasons["no-agent-user"]["build"]
    assert "unable to find user user" in reasons["no-agent-user"]["build"]


@pytest.mark.bwrap
@needs_bwrap
def test_solve_with_the_tmax_agent(tmp_path):
    """pass@k of a model agent: one attempt solves the task, the other does not."""
    import sys

    from tmax.agents.prompts import SUBMIT_COMMAND
    from scripted_server import ScriptedServer

    root = copy_corpus(tmp_path, ["good"])
    turns = [{"bash": "wc -l < /app/files/words.txt > /app/count.txt"}, {"bash": SUBMIT_COMMAND},
             {"bash": "echo 9 > /app/count.txt"}, {"bash": SUBMIT_COMMAND}]
    with ScriptedServer(turns) as srv:
        r = runner.invoke(app, ["data", "solve", str(root), "-a", "tmax", "-m", srv.model, "--base-url",
                                srv.base_url, "-k", "2", "-n", "1", "-e", "bwrap", "--band", "0.1:0.9", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    s = data["tasks"]["good"]
    assert (s["num_attempts"], s["num_runs"], s["num_success"], s["success_rate"]) == (2, 2, 1, 0.5)
    assert s["pass_at_k"] == {"1": 0.5, "2": 1.0}
    assert data["band"] == ["good"]  # solved 1 of 2 times: in band (pass@2 = 1 would have left it out)
    assert (root / ".tmax-solve" / "tmax_scripted-model" / "good.json").is_file()


@pytest.mark.bwrap
@needs_bwrap
def test_validate_killed_midway_resumes_without_redoing_finished_tasks(tmp_path):
    """Kill `validate` once two tasks have finished: the rerun reads their results back
    (same content, no infrastructure error) and runs only the others."""
    import os
    import signal
    import subprocess
    import sys

    root = tmp_path / "corpus"
    for name in ("a-good", "b-good", "c-slow", "d-good"):
        shutil.copytree(DATA / "good", root / name)
    with open(root / "c-slow" / "solution" / "solve.sh", "a") as f:
        f.write("sleep 30\n")  # still running when the first run is killed
    cmd = [sys.executable, "-m", "tmax.cli.main", "data", "validate", str(root), "-e", "bwrap", "-n", "1", "--jsonl"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    first = []
    try:
        for line in proc.stdout:
            first.append(json.loads(line)["task"])
            if len(first) == 2:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert first == ["a-good", "b-good"]
    results = root / ".tmax-validate" / "results"
    stamps = {t: (results / f"{t}.json").stat().st_mtime_ns for t in first}
    trial = root / ".tmax-validate" / "a-good" / "nop" / "result.json"
    trial_stamp = trial.stat().st_mtime_ns
    # the rerun: c-slow is fast again (a changed task is validated afresh anyway)
    shutil.copyfile(DATA / "good" / "solution" / "solve.sh", root / "c-slow" / "solution" / "solve.sh")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    done = {x["task"]: x for x in lines if "task" in x}
    assert {t for t, x in done.items() if x["resumed"]} == {"a-good", "b-good"}
    assert all(x["verdict"] == "ok" for x in done.values()) and lines[-1]["counts"]["ok"] == 4
    assert {t: (results / f"{t}.json").stat().st_mtime_ns for t in first} == stamps
    assert trial.stat().st_mtime_ns == trial_stamp  # its trials were not run again


@pytest.mark.bwrap
@needs_bwrap
def test_solve_reports_a_task_that_does_not_load_and_solves_the_rest(tmp_path):
    root = copy_corpus(tmp_path, ["good", "bad-toml"])
    r = runner.invoke(app, ["data", "solve", str(root), "-a", "oracle", "-k", "1", "-e", "bwrap", "--json"])
    assert r.exit_code == 1, r.output  # not a clean result
    data = json.loads(r.stdout)
    assert list(data["tasks"]) == ["good"] and data["tasks"]["good"]["num_success"] == 1
    assert list(data["unreadable"]) == ["bad-toml"] and "task.toml" in data["unreadable"]["bad-toml"]
