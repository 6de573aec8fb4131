"""`tmax data generate` end to end against a scripted OpenAI-compatible generator: 12 tasks
on the bwrap host sandbox, with canned answers that break each gate; the retry loop
feeds the gate's error back, kept tasks pass all five gates on a fresh `validate`, broken
ones are rejected with the right gate named; a rerun resumes without calling the model."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmax.tasks.corpus.axes import sample_axes
from tmax.tasks.corpus.axes import load_axes, stratified_plan
from tmax.tasks.corpus.balance_report import balance_score
from tmax.tasks.task_format import Task
from tmax.cli.main import app

from data_scripted_generator import PODMAN_USER_SETUP, Responder  # noqa: E402
from scripted_server import ScriptedServer  # noqa: E402

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

# Every failing case once, then good tasks; the slots of the four that always fail are re-drawn.
PLAN = ["parse_then_ok", "build_then_ok", "build_always", "nop_then_ok", "nop_always", "oracle_then_ok",
        "oracle_always", "initial_always"] + ["good"] * 4
N_TASKS = len(PLAN)
EXPECTED_REJECTED = {"build_always": "build", "nop_always": "nop", "oracle_always": "oracle",
                     "initial_always": "initial"}


def case_of(task_dir: Path) -> str:
    return (task_dir / "instruction.md").read_text().split("\n")[0].removeprefix("CASE=")


def test_plan_is_seeded_and_stratified():
    a, b = stratified_plan(100, 7, "rl_v2"), stratified_plan(100, 7, "rl_v2")
    assert a == b and stratified_plan(100, 8, "rl_v2") != a
    buckets = load_axes().buckets()
    domains = Counter(t.domain for t in a)
    assert max(domains.values()) - min(domains.values()) <= 1 and len(domains) == 9  # 11 or 12 each
    assert balance_score(domains, 9) >= 0.999
    # within a domain, its skill types differ by at most one task
    for d in domains:
        skills = Counter(t.skill_type for t in a if t.domain == d)
        assert max(skills.values()) - min(skills.values()) <= 1
    # the other axes follow their weights to the unit: Python 0.35, intricate 3/4 in rl_v2
    assert Counter(t.language for t in a)["Python"] == 35
    assert Counter(t.task_complexity for t in a)["intricate"] == 75
    assert balance_score(Counter(t.command_complexity for t in a), len(buckets["command_complexity"])) > 0.999


def test_corpus_kind_weights():
    rng = random.Random(0)
    legacy = [sample_axes(rng, "legacy") for _ in range(400)]
    assert {a.verifier_kind for a in legacy} == {"exact_text"} and {a.fixture_kind for a in legacy} == {"text_only"}
    assert "intricate" not in {a.task_complexity for a in legacy}
    rl = [sample_axes(rng, "rl_v2") for _ in range(2000)]
    assert all(a.verifier_kind != "exact_text" and a.fixture_kind != "text_only" for a in rl)
    share = sum(a.task_complexity == "intricate" for a in rl) / len(rl)
    assert 0.72 < share < 0.78  # M = 3 -> 3/4
    sft = [sample_axes(rng, "sft_v2") for _ in range(2000)]
    assert 0.63 < sum(a.verifier_kind != "exact_text" for a in sft) / 2000 < 0.70  # M = 2 -> 2/3
    assert all(a.base_image == "intricate" for a in rl)
    anchors = sum(a.anchor is not None for a in sft) / 2000
    assert 0.31 < anchors < 0.39


@pytest.mark.bwrap
@needs_bwrap
def test_generate_tasks_with_broken_gates(tmp_path):
    out = tmp_path / "corpus"
    responder = Responder(PLAN)
    runner = CliRunner()
    with ScriptedServer(responder) as srv:
        args = ["data", "generate", "-o", str(out), "-N", str(N_TASKS), "--base-url", srv.base_url, "-m", srv.model,
                "--seed", "3", "-e", "bwrap", "-n", "4", "--max-retries", "1", "--json"]
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        summary = json.loads(r.stdout)
        requests = srv.requests
        # the 4 tasks that always fail are rejected and their slots re-drawn (and kept)
        rows = summary["tasks"]
        assert summary["counts"] == {"kept": N_TASKS, "rejected": 4, "pending": 0}, [r for r in rows if r["status"] != "kept"]
        for slot in range(N_TASKS):  # every slot ends kept, in the stratum of its first task
            tasks = [t for t in rows if t["slot"] == slot]
            assert [t["status"] for t in tasks] == ["rejected"] * (len(tasks) - 1) + ["kept"]
            assert len({(t["domain"], t["skill_type"]) for t in tasks}) == 1

        # The retry loop: each "_then_ok" case got its gate's error back and then passed.
        fed_back = Counter()
        for body in requests:
            user = body["messages"][-1]["content"]
            for gate in ("parse", "build", "nop", "oracle", "initial"):
                if f"gate `{gate}` failed" in user:
                    fed_back[gate] += 1
        assert fed_back["parse"] == 1 and fed_back["nop"] >= 2 and fed_back["build"] >= 2
        assert fed_back["oracle"] >= 2 and fed_back["initial"] >= 1

        kept = sorted(d for d in out.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))
        rejected = {case_of(d): d for d in (out / "_rejected").iterdir()}
        assert len(kept) == N_TASKS and set(rejected) == set(EXPECTED_REJECTED)
        for case, gate in EXPECTED_REJECTED.items():  # every reject keeps its gate and reason
            why = json.loads((rejected[case] / "rejection.json").read_text())
            assert why["failed_gate"] == gate and why["reason"]
        # Tasks for a normal user; bwrap cannot switch user and runs them as the invoking one.
        assert all(Task.load(d).config.agent.user == "user" for d in kept)
        states = {s["task"]: s for s in summary["tasks"]}
        for case, gate in EXPECTED_REJECTED.items():
            assert states[rejected[case].name]["failed_gate"] == gate
        for d in kept:
            task = Task.load(d)  # plain Harbor tasks, with the axes in [metadata]
            assert task.has_solution and task.config.metadata["domain"]
            assert (d / "tests" / "test_final_state.py").is_file()

        # A rerun skips finished tasks: no model call at all.
        n_before = len(srv.requests)
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert len(srv.requests) == n_before

    # The output is a plain Harbor dataset that `tmax bench` runs.
    r = runner.invoke(app, ["bench", "run", str(out), "-a", "oracle", "-e", "bwrap", "-l", "2",
                            "-o", str(tmp_path / "jobs"), "--job-name", "oracle"])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "jobs" / "oracle" / "result.json").read_text())
    assert result["tmax_score"]["mean_reward"] == 1.0 and result["n_total_trials"] == 2

    # A fresh validate of what was kept: every task passes all five gates ...
    r = runner.invoke(app, ["data", "validate", str(out), "-e", "bwrap", "-n", "4", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["counts"]["ok"] == N_TASKS and data["counts"]["tasks"] == N_TASKS
    assert all(t["verdict"] == "ok" and t["failed"] == [] for t in data["tasks"])
    # ... and the rejected ones are rejected again, naming their gate.
    r = runner.invoke(app, ["data", "validate", str(out / "_rejected"), "-e", "bwrap", "--json"])
    verdicts = {case_of(out / "_rejected" / t["task"]): (t["verdict"], t["failed"]) for t in json.loads(r.stdout)["tasks"]}
    assert verdicts["build_always"] == ("rejected", ["build"])
    assert verdicts["nop_always"] == ("rejected", ["nop"])
    assert verdicts["oracle_always"] == ("rejected", ["oracle"])
    assert verdicts["initial_always"] == ("rejected", ["initial"])


@pytest.mark.podman
@pytest.mark.skipif(shutil.which("podman") is None, reason="needs podman")
def test_generate_on_podman(tmp_path):
    """The same pipeline with real image builds: the canned Dockerfiles install python3 on
    the base image (one shared cached layer); a failed build is fed back and fixed."""
    from tmax.sandbox.base_image import image_exists
    from tmax.tasks.task_images import BASE_TAG

    if not image_exists(BASE_TAG):
        pytest.skip("needs the base image")
    setup = ("RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-minimal\n"
             + PODMAN_USER_SETUP)
    out = tmp_path / "corpus"
    with ScriptedServer(Responder(["good", "build_then_ok"], podman_setup=setup)) as srv:
        r = CliRunner().invoke(app, ["data", "generate", "-o", str(out), "-N", "2", "--base-url", srv.base_url,
                                     "-m", srv.model, "-e", "podman", "-n", "2", "--max-retries", "1", "--json"])
    assert r.exit_code == 0, r.output
    rows = {case_of(out / ("_rejected" if t["status"] == "rejected" else "") / t["task"]): t
            for t in json.loads(r.stdout)["tasks"]}
    assert rows["good"]["status"] == "kept" and rows["good"]["rounds"] == 1
    assert rows["build_then_ok"]["status"] == "kept" and rows["build_then_ok"]["rounds"] == 2
    good = Task.load(out / rows["good"]["task"])
    # The oracle gate ran solve.sh as the agent's user, which owns what it wrote.
    assert good.has_solution and good.config.agent.user == "user" and good.config.verifier.user is None


@pytest.mark.bwrap
@needs_bwrap
def test_endpoint_failure_leaves_tasks_pending_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "corpus"
    args = ["data", "generate", "-o", str(out), "-N", "1", "-e", "bwrap", "--json", "-m", "scripted-model"]
    with ScriptedServer(lambda body: {"error": "auth"}) as srv:
        r = CliRunner().invoke(app, [*args, "--base-url", srv.base_url])
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["counts"] == {"kept": 0, "rejected": 0, "pending": 1}
    with ScriptedServer(Responder(["good"])) as srv:
        r = CliRunner().invoke(app, [*args, "--base-url", srv.base_url])
        assert len(srv.requests) == 4  # the four stages, once each
    assert json.loads(r.stdout)["counts"] == {"kept": 1, "rejected": 0, "pending": 0}
    r = CliRunner().invoke(app, [*args, "--base-url", "http://127.0.0.1:9/v1", "--seed", "1"])
    assert r.exit_code == 2 and "seed" in r.output  # a resumed corpus keeps its seed


def test_prompts_and_parsers():
    from tmax.tasks.corpus import stage_prompts as prompts
    from tmax.tasks.corpus.package import TaskParts, write_task

    axes = stratified_plan(1, 0, "rl_v2")[0]
    user = prompts.template_messages(axes)[1]["content"]
    assert f"Category: {axes.skill_type}" in user and "## v2 Axes" in user and f"Verifier kind: {axes.verifier_kind}" in user
    assert "## Previous failures" not in user
    system = prompts.final_test_messages("t", "truth", "init", None, "metric_threshold")[0]["content"]
    assert "numpy" in system and "threshold" in system
    assert prompts.parse_template("x <task>\nDo it.\n</task> <truth>42</truth>") == ("Do it.", "42")
    with pytest.raises(prompts.ParseError, match="truth"):
        prompts.parse_template("<task>only</task>")
    with pytest.raises(prompts.ParseError, match="compile"):
        prompts.parse_python("```python\ndef f(:\n```")
    with pytest.raises(prompts.ParseError, match="placeholder"):
        prompts.parse_environment("<dockerfile>FROM {{ image }}</dockerfile><solve>true</solve>")
    docker, files, solve = prompts.parse_environment(
        '<dockerfile>\nFROM b\n</dockerfile>\n<file path="d/a.txt">\nx\n</file><solve>\nls\n</solve>')
    assert (docker, files, solve) == ("FROM b\n", {"d/a.txt": "x\n"}, "ls\n")
    assert prompts.feedback_text("build", "e" * 900).endswith("e" * 500) and len(prompts.feedback_text("b", "e" * 900)) < 540
    with pytest.raises(ValueError, match="stay inside"):
        write_task(TaskParts("t", axes, "do", dockerfile="FROM b", env_files={"../escape": "x"}), Path("/tmp/never"))
    # The agent is a normal user in its home; the image keeps root for the verifier.
    env_system = prompts.environment_messages("security", "t", "truth", "init", "final")[0]["content"]
    assert "useradd -m user" in env_system and "WORKDIR /home/user" in env_system and "no USER line" in env_system
    with pytest.raises(prompts.ParseError, match="keep root"):
        prompts.parse_environment("<dockerfile>FROM b\nRUN useradd -m user\nUSER user\n</dockerfile><solve>ls</solve>")
    assert prompts.parse_environment("<dockerfile>FROM b\nUSER nobody\nUSER root\n</dockerfile><solve>ls</solve>")


def test_generated_task_toml_names_the_agent_user_and_loads_in_harbor(tmp_path):
    from harbor_env import HARBOR_PYTHON

    from tmax.tasks.corpus.package import TaskParts, write_task

    parts = TaskParts("t1", stratified_plan(1, 0, "rl_v2")[0], "do it", dockerfile="FROM b", final_test="x = 1\n",
                      solution="ls")
    task = Task.load(write_task(parts, tmp_path / "t1"))
    assert task.config.agent.user == "user" and task.config.verifier.user is None
    if not HARBOR_PYTHON.exists():
        pytest.skip("no .venv-harbor")
    check = ("import sys; from harbor.models.task.config import TaskConfig; "
             "c = TaskConfig.model_validate_toml(open(sys.argv[1]).read()); print(c.agent.user, c.verifier.user)")
    proc = subprocess.run([str(HARBOR_PYTHON), "-c", check, str(task.path / "task.toml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["user", "None"]


@pytest.mark.bwrap
@needs_bwrap
def test_resume_mid_task_keeps_finished_stages(tmp_path):
    """An endpoint that dies at the final-test stage: the rerun asks only for what is missing."""
    from data_scripted_generator import stage_of

    good = Responder(["good"])

    def dies_at_final(body: dict) -> dict:
        return {"error": "auth"} if stage_of(body) == "final" else good(body)

    out = tmp_path / "corpus"
    args = ["data", "generate", "-o", str(out), "-N", "1", "-e", "bwrap", "--json", "-m", "scripted-model"]
    with ScriptedServer(dies_at_final) as srv:
        assert CliRunner().invoke(app, [*args, "--base-url", srv.base_url]).exit_code == 1
    state = json.loads(next((out / ".generate").glob("task_*.json")).read_text())
    assert state["task"] and state["initial_test"] and state["final_test"] is None
    with ScriptedServer(good) as srv:
        r = CliRunner().invoke(app, [*args, "--base-url", srv.base_url])
        assert [stage_of(b) for b in srv.requests] == ["final", "environment"]
    assert json.loads(r.stdout)["counts"]["kept"] == 1


@pytest.mark.bwrap
@pytest.mark.slow
@needs_bwrap
def test_stratified_generation_keeps_the_domain_balance(tmp_path):
    """18 slots (two per domain), five of whose tasks always fail a gate: each rejected
    task is re-drawn from its stratum, so the kept corpus is as balanced as the plan (the
    paper: 0.998 on its 15K). The plan puts two tasks in each domain, so the kept corpus
    must too: one re-draw from another stratum would leave 1 and 3 (balance 0.971)."""
    out = tmp_path / "corpus"
    with ScriptedServer(Responder(["nop_always"] * 5)) as srv:
        r = CliRunner().invoke(app, ["data", "generate", "-o", str(out), "-N", "18", "--base-url", srv.base_url,
                                     "-m", srv.model, "-e", "bwrap", "-n", "8", "--max-retries", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["counts"] == {"kept": 18, "rejected": 5, "pending": 0}
    report = json.loads(CliRunner().invoke(app, ["data", "report", str(out), "--json"]).stdout)
    assert report["n"] == 18 and report["missing"]["domain"] == 0
    assert set(report["counts"]["domain"].values()) == {2} and len(report["counts"]["domain"]) == 9, report["counts"]
    assert report["balance"]["domain"] == pytest.approx(1.0)


@pytest.mark.bwrap
@needs_bwrap
def test_nothing_kept_exits_non_zero_and_every_reject_keeps_its_reason(tmp_path):
    out = tmp_path / "corpus"
    # a template that never parses (no retry allowed) and a task whose final test passes untouched
    with ScriptedServer(Responder(["parse_then_ok", "nop_always"])) as srv:
        r = CliRunner().invoke(app, ["data", "generate", "-o", str(out), "-N", "2", "--base-url", srv.base_url,
                                     "-m", srv.model, "-e", "bwrap", "-n", "1", "--max-retries", "0",
                                     "--max-redraws", "0", "--json"])
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["counts"] == {"kept": 0, "rejected": 2, "pending": 0}
    reasons = {json.loads(p.read_text())["failed_gate"]: json.loads(p.read_text())["reason"]
               for p in (out / "_rejected").glob("*/rejection.json")}
    assert set(reasons) == {"parse", "nop"} and "<truth>" in reasons["parse"]
    assert "untouched environment" in reasons["nop"]


@pytest.mark.bwrap
@needs_bwrap
def test_validate_one_task_writes_nothing_into_it(tmp_path):
    root = tmp_path / "corpus"
    shutil.copytree(Path(__file__).parents[1] / "data" / "corpus" / "validate" / "good", root / "good")
    before = sorted(p.relative_to(root) for p in (root / "good").rglob("*"))
    r = CliRunner().invoke(app, ["data", "validate", str(root / "good"), "-e", "bwrap", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["counts"]["ok"] == 1
    assert sorted(p.relative_to(root) for p in (root / "good").rglob("*")) == before
    assert (root / ".tmax-validate" / "good" / "gates.json").is_file()
