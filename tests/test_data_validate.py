"""`tmax data validate` and `tmax data solve` on a hand-made corpus with one known defect
per task (bwrap host sandbox), and the gates on real podman images."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tasks.images import BASE_TAG, image_exists
from tmax_cli.main import app

DATA = Path(__file__).parent / "data" / "corpus" / "validate"
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
    r = runner.invoke(app, ["data", "validate", str(root), "-e", "podman", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    got = {t["task"]: (t["verdict"], t["failed"]) for t in json.loads(r.stdout)["tasks"]}
    assert got == {"good": ("ok", []), "wrong-solution": ("rejected", ["oracle"]),
                   "broken-build": ("rejected", ["build"]), "no-agent-user": ("rejected", ["build"])}
    reasons = {t["task"]: t["reasons"] for t in json.loads(r.stdout)["tasks"]}
    assert "setup failed" in reasons["broken-build"]["build"]
    assert "[agent] user = 'user'" in reasons["no-agent-user"]["build"]
    assert "unable to find user user" in reasons["no-agent-user"]["build"]


@pytest.mark.bwrap
@needs_bwrap
def test_solve_with_the_tmax_agent(tmp_path):
    """pass@k of a model agent: one attempt solves the task, the other does not."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from agents.prompts import SUBMIT_COMMAND
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
