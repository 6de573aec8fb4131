"""`tmax data report | decontam | combine | import` and the solve summaries, on small
hand-made corpora with known axis counts, planted overlaps and each published layout."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmax.common.records import SolveSummary
from tmax.tasks.corpus.axes import load_axes
from tmax.tasks.corpus.import_native import dockerfile_from_def
from tmax.tasks.corpus.balance_report import balance_score
from tmax.tasks.harbor import TrialScore
from tmax.tasks.corpus.solve import in_band, parse_band, task_summary
from tmax.tasks.scoring import TrialRow
from tmax.tasks.task_format import Task
from tmax.cli.main import app

DATA = Path(__file__).parents[1] / "data" / "corpus"
runner = CliRunner()
BUCKETS = load_axes().buckets()


def run_json(*args: str) -> dict:
    r = runner.invoke(app, ["data", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# --- balance and report ------------------------------------------------------------------

def test_balance_score_hand_computed():
    # 3/2/1 over N = 9: H = -(1/2 ln 1/2 + 1/3 ln 1/3 + 1/6 ln 1/6) = 1.011404, exp(H) = 2.749459
    assert balance_score({"a": 3, "b": 2, "c": 1}, 9) == pytest.approx(2.749459 / 9, abs=1e-6)
    assert balance_score({d: 5 for d in BUCKETS["domain"]}, 9) == pytest.approx(1.0)
    assert balance_score({"security": 40}, 9) == pytest.approx(1 / 9)
    assert balance_score({}, 9) == 0.0
    assert balance_score({"x": 3}, 1) == 1.0
    assert len(BUCKETS["domain"]) == 9


def test_report_counts_and_balance(tmp_path):
    png = tmp_path / "report.png"
    data = run_json("report", str(DATA / "report"), "--png", str(png))
    assert data["n"] == 6
    assert data["counts"]["domain"] == {"security": 3, "debugging": 2, "data_science": 1}
    # the long description in dbg-1 counts as its key
    assert data["counts"]["task_complexity"] == {"moderate": 2, "short": 2, "complex": 1, "intricate": 1}
    assert data["counts"]["primitive_skills"] == {"Cron scheduling": 6, "Log rotation": 6}
    assert data["balance"]["domain"] == pytest.approx(2.749459 / 9, abs=1e-5)
    # skill_type 3/1/1/1 over the 29 names: H = -(1/2 ln 1/2 + 3 * 1/6 ln 1/6) = ln(12) / 2,
    # exp(H) = sqrt(12) = 3.464102, / 29 = 0.119452
    assert data["balance"]["skill_type"] == pytest.approx(0.119452, abs=1e-5)
    # task_complexity 2/2/1/1 over 4
    h_cx = -(2 * (1 / 3) * math.log(1 / 3) + 2 * (1 / 6) * math.log(1 / 6))
    assert data["balance"]["task_complexity"] == pytest.approx(math.exp(h_cx) / 4, abs=1e-5)
    hist = data["success_rate"]["oracle"]
    assert hist["k"] == [2, 2] and hist["n"] == [2, 2] and hist["tasks"] == 5
    # c/n: three tasks 2/2, one 1/2, one 0/2 (pass@2 would put the 1/2 task with the 2/2 ones)
    assert (hist["counts"][9], hist["counts"][5], hist["counts"][0]) == (3, 1, 1)
    assert data["missing"]["domain"] == 0 and data["outside_buckets"]["domain"] == {}
    assert set(data["balance"]) == {"domain", "skill_type", "primitive_skills", "scenario", "language",
                                    "task_complexity", "command_complexity", "verifier_kind", "fixture_kind"}
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


TB2 = Path(__file__).resolve().parents[3] / "shared" / "tb2-sample"


@pytest.mark.skipif(not TB2.is_dir(), reason="needs the Terminal-Bench 2.0 sample")
def test_report_on_labelled_and_unlabelled_tasks_states_what_is_missing(tmp_path):
    """TB2 tasks carry no axes but a `category`: it becomes the domain where it names one,
    the rest is reported outside the buckets, and nothing lacking an axis is hidden."""
    root = tmp_path / "mixed"
    for d in (DATA / "report").iterdir():
        if d.is_dir() and not d.name.startswith("."):
            (root / d.name).parent.mkdir(parents=True, exist_ok=True)
            (root / d.name).symlink_to(d.resolve())
    tb2 = sorted(d for d in TB2.iterdir() if (d / "task.toml").is_file())
    for d in tb2:
        (root / d.name).symlink_to(d)
    # an importer's placeholder value, outside the declared buckets
    unknown = root / "imported-unknown"
    unknown.mkdir()
    (unknown / "task.toml").write_text('[metadata]\ndomain = "unknown"\nskill_type = "unknown"\n')
    data = run_json("report", str(root))
    assert data["n"] == 6 + len(tb2) + 1
    assert all(0 <= b <= 1 for b in data["balance"].values()), data["balance"]
    # 6 labelled tasks have a skill type; TB2's tasks lack it and are counted, not dropped
    assert data["missing"]["skill_type"] == len(tb2)
    assert data["outside_buckets"]["skill_type"] == {"unknown": 1}
    dom = data["counts"]["domain"]
    assert dom["software_engineering"] >= 1 and "software-engineering" not in dom
    assert data["outside_buckets"]["domain"]["unknown"] == 1
    assert "games" in data["outside_buckets"]["domain"]  # a TB2 category with no domain
    labelled = {v: c for v, c in dom.items() if v not in data["outside_buckets"]["domain"]}
    assert data["balance"]["domain"] == pytest.approx(balance_score(labelled, 9), abs=1e-6)
    assert data["missing"]["domain"] == data["n"] - sum(dom.values())


def test_balance_never_exceeds_one_with_values_outside_the_buckets(tmp_path):
    """Nine domains, one task each, plus one "unknown": before, 10 values over N = 9 gave 1.111."""
    for i, d in enumerate(list(BUCKETS["domain"]) + ["unknown"]):
        (tmp_path / f"t{i}").mkdir()
        (tmp_path / f"t{i}" / "task.toml").write_text(f'[metadata]\ndomain = "{d}"\n')
    data = run_json("report", str(tmp_path))
    assert data["balance"]["domain"] == pytest.approx(1.0)
    assert data["outside_buckets"]["domain"] == {"unknown": 1}


# Per-domain persona counts of the original (reference §2.3).
PERSONAS_PER_DOMAIN = {"security": 9, "software_engineering": 15, "file_operations": 7, "data_querying": 6,
                       "data_science": 6, "debugging": 12, "scientific_computing": 5, "data_processing": 7,
                       "system_administration": 18}


def test_bundled_axes_have_the_reference_cardinalities():
    axes = load_axes()
    domains = axes.domains
    assert list(domains) == list(PERSONAS_PER_DOMAIN)
    # skill types: 4-7 per domain, 52 (domain, type) pairs, 29 names, each once in the bucket list
    assert all(4 <= len(d.skill_types) <= 7 and len(set(d.skill_types)) == len(d.skill_types) for d in domains.values())
    assert sum(len(d.skill_types) for d in domains.values()) == 52
    assert len(BUCKETS["skill_type"]) == len(set(BUCKETS["skill_type"])) == 29
    assert set(BUCKETS["skill_type"]) == {s for d in domains.values() for s in d.skill_types}
    assert domains["security"].skill_types == ["Systems", "Data Processing", "Web Security", "Algorithmic", "Testing"]
    assert {"Mathematical", "Multi-Language"} <= set(domains["software_engineering"].skill_types)
    assert "Forensics" in domains["debugging"].skill_types
    # primitive skills: 20-40 per domain, distinct within it, 283 in all
    assert all(20 <= len(d.skills) <= 40 and len(set(d.skills)) == len(d.skills) for d in domains.values())
    assert sum(len(d.skills) for d in domains.values()) == 283
    assert "Graph traversal and dependency resolution" in domains["software_engineering"].skills
    assert "Cryptographic hashing and checksum verification" in domains["security"].skills
    assert "Git bisection for regression finding" in domains["debugging"].skills
    # personas: the original's count per domain, 85 slots, 73 distinct (some shared between domains)
    assert {name: len(d.scenarios) for name, d in domains.items()} == PERSONAS_PER_DOMAIN
    slots = [p for d in domains.values() for p in d.scenarios]
    assert len(slots) == 85 and len(set(slots)) == 73
    assert all(len(set(d.scenarios)) == len(d.scenarios) for d in domains.values())
    assert all(3 <= len(d.anchors) <= 7 for d in domains.values())
    assert "a JWT implementation that accepts tokens with algorithm=none" in domains["security"].anchors
    # the domain-free axes of reference §2.1
    assert axes.languages == {"Python": 0.35, "C": 0.15, "Bash": 0.15, "C++": 0.1, "Rust": 0.07, "Go": 0.07,
                              "multi-language": 0.06, "any (model's choice)": 0.05}
    assert list(axes.task_complexity) == ["short", "moderate", "complex", "intricate"]
    assert axes.new_task_complexity == ["intricate"] and len(axes.command_complexity) == 3
    assert len(axes.verifier_kinds) == 5 and axes.verifier_kinds[0] == "exact_text"
    assert len(axes.fixture_kinds) == 7 and axes.fixture_kinds[0] == "text_only"
    assert axes.anchor_probability == 0.35


# --- decontamination ---------------------------------------------------------------------

def test_decontam_finds_the_planted_copy_only(tmp_path):
    data = run_json("decontam", str(DATA / "decontam"), "--against", str(DATA / "bench"))
    assert data == {"hits": [{"task": "planted", "benchmark_task": "alpha", "shared_ngrams": 8}], "checked": 3,
                    "unreadable": {}}
    # 8-grams also catch the near miss (12 shared words -> 5 eight-grams)
    data = run_json("decontam", str(DATA / "decontam"), "--against", str(DATA / "bench"), "--n", "8")
    assert {(h["task"], h["shared_ngrams"]) for h in data["hits"]} == {("planted", 13), ("near-miss", 5)}
    out = tmp_path / "clean"
    data = run_json("decontam", str(DATA / "decontam"), "--against", str(DATA / "bench"), "--drop", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["clean", "near-miss"] == sorted(data["kept"])


def test_decontam_reports_an_unreadable_task_and_checks_the_rest(tmp_path):
    import shutil

    root = tmp_path / "corpus"
    shutil.copytree(DATA / "decontam", root)
    (root / "clean" / "task.toml").write_text("[metadata\n")
    r = runner.invoke(app, ["data", "decontam", str(root), "--against", str(DATA / "bench"), "--json"])
    assert r.exit_code == 1, r.output  # not a clean result: one task was not checked
    data = json.loads(r.stdout)
    assert data["checked"] == 2 and [h["task"] for h in data["hits"]] == ["planted"]
    assert list(data["unreadable"]) == ["clean"] and "task.toml" in data["unreadable"]["clean"]
    r = runner.invoke(app, ["data", "decontam", str(root), "--against", str(DATA / "bench")])
    assert "unreadable" in r.output and "clean" in r.output


# --- combine -----------------------------------------------------------------------------

def test_combine_union_and_balanced(tmp_path):
    data = run_json("combine", str(DATA / "report"), str(DATA / "decontam"), "-o", str(tmp_path / "u"))
    assert data["n"] == 9 and (tmp_path / "u" / "sec-1").is_symlink()
    data = run_json("combine", str(DATA / "report"), "-o", str(tmp_path / "b"), "--mode", "balanced", "--total", "5")
    assert data["n"] == 5 and "dbg-2" not in data["tasks"]  # 5 non-intricate, no room for the intricate one
    data = run_json("combine", str(DATA / "report"), "-o", str(tmp_path / "b6"), "--mode", "balanced", "--total", "9")
    assert data["n"] == 6 and "dbg-2" in data["tasks"]
    r = runner.invoke(app, ["data", "combine", str(DATA / "report"), str(DATA / "report"), "-o", str(tmp_path / "d")])
    assert r.exit_code == 2 and "in both" in r.output


# --- import ------------------------------------------------------------------------------

def test_import_harbor(tmp_path):
    data = run_json("import", str(DATA / "import" / "harbor"), "-o", str(tmp_path), "--format", "harbor")
    assert data["imported"] == ["task_000001_ab12cd34"]
    assert Task.load(tmp_path / "task_000001_ab12cd34").config.agent.user is None  # as its task.toml says
    assert "Dockerfile" in data["errors"]["task_000002_broken"]
    assert not (tmp_path / "task_000002_broken").exists()
    rep = run_json("report", str(tmp_path))
    assert rep["counts"]["task_complexity"] == {"moderate": 1}
    assert rep["counts"]["command_complexity"] == {"bash-only": 1}


def test_import_open_instruct(tmp_path):
    """The RL training copy as published (see `tasks/corpus/import_open_instruct.py` for the
    layout): per-task folders with optional image.txt / setup.sh / seeds, and dataset rows
    (`train.jsonl`) with the field names messages / ground_truth / dataset / env_config{env_name,
    image, task_id} / source."""
    r = runner.invoke(app, ["data", "import", str(DATA / "import" / "open-instruct"), "-o", str(tmp_path),
                            "--format", "open-instruct", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["imported"] == ["oi_0001", "oi_0002", "oi_0003", "oi_0004"]
    assert "image.txt" in data["errors"]["oi_0005"] and "setup.sh" in data["errors"]["oi_0005"]
    assert "no task folder" in data["errors"]["oi_0009"]  # a row whose folder is missing
    # the row's env_config.image comes before image.txt
    task = Task.load(tmp_path / "oi_0001")
    assert task.config.environment.docker_image == "registry.example.org/tmax/oi_0001:v2"
    assert task.dockerfile.read_text() == ("FROM registry.example.org/tmax/oi_0001:v2\nCOPY seeds/ /workspace/\n"
                                           "WORKDIR /workspace\n")
    assert (task.tests_dir / "test.sh").is_file() and (task.tests_dir / "pytest_lite.py").is_file()
    meta = task.config.metadata
    assert (meta["env_name"], meta["ground_truth"], meta["task_id"]) == ("swerl_vanillux_sandbox", "oi_0001", "oi_0001")
    # no image.txt: the row names the image
    assert Task.load(tmp_path / "oi_0002").config.environment.docker_image.endswith("oi_0002:latest")
    # setup.sh is the environment: a RUN step on the defs' base, the seeds after it; no image named
    task = Task.load(tmp_path / "oi_0003")
    docker = task.dockerfile.read_text()
    assert docker.startswith("FROM ubuntu:22.04\n") and "RUN bash -e /tmp/tmax-setup.sh" in docker
    assert docker.index("RUN bash -e") < docker.index("COPY seeds/ /workspace/")
    assert "useradd -m user" in (task.environment_dir / "setup.sh").read_text()
    assert task.config.environment.docker_image is None
    # no instruction.md: the row's user message
    assert Task.load(tmp_path / "oi_0004").instruction.strip() == "Write hello to /workspace/hello.txt."


def test_import_native(tmp_path):
    """The generator's layout (documented in `tasks/corpus/import_native.py`): task.json,
    container.def with %environment / %post / %files, setup.sh, fixtures/, task_summary.txt and
    solutions/*summary.json."""
    data = run_json("import", str(DATA / "import" / "native"), "-o", str(tmp_path), "--format", "native")
    assert data == {"imported": ["task_000007_0badf00d", "task_000008_1ntr1cat"], "errors": {}}
    task = Task.load(tmp_path / "task_000007_0badf00d")
    meta = task.config.metadata
    assert meta["domain"] == "data_processing" and meta["task_complexity"] == "short"
    assert meta["command_complexity"] == "bash-and-code" and "anchor" not in meta
    assert task.instruction.startswith("Deduplicate /home/user/export.csv")
    docker = task.dockerfile.read_text()
    assert docker.startswith("FROM ubuntu:22.04") and "ENV LC_ALL=C.UTF-8" in docker
    assert "COPY fixtures/ /app/fixtures/" in docker
    assert "useradd -m user" in (task.environment_dir / "post_install.sh").read_text()
    # A full def installs what it needs itself: no shared base layer.
    assert "apt-get install" not in docker
    # The def creates the user itself; the agent runs as it, in its home.
    assert task.config.agent.user == "user" and "useradd" not in docker and docker.endswith("WORKDIR /home/user\n")
    assert (task.environment_dir / "fixtures" / "sample.txt").is_file()
    assert (task.tests_dir / "test_initial_state.py").is_file() and not task.has_solution
    assert "dedup.csv keeps the first" in (task.path / "truth.md").read_text()


def test_import_native_intricate_files_and_summaries(tmp_path):
    run_json("import", str(DATA / "import" / "native"), "-o", str(tmp_path), "--format", "native")
    task = Task.load(tmp_path / "task_000008_1ntr1cat")
    docker = task.dockerfile.read_text()
    # base_image = "intricate": the shared intricate layer, before the task's own files and %post
    assert "ffmpeg" in docker and "tesseract-ocr" in docker and "numpy" in docker and "Pillow" in docker
    # %files destinations: the relative source and the original build's absolute one
    assert "COPY fixtures/labels.json /opt/labels/labels.json" in docker
    assert "COPY fixtures/img.png /app/fixtures/img.png" in docker
    assert "COPY fixtures/ /app/fixtures/" not in docker
    assert docker.index("pip3 install") < docker.index("COPY fixtures/labels.json") < docker.index("post_install")
    assert (task.environment_dir / "fixtures" / "labels.json").is_file()
    meta = task.config.metadata
    assert meta["task_complexity"] == "intricate" and meta["base_image"] == "intricate"
    assert meta["task_summary"].startswith("Intricate ML labelling task")
    sol = meta["solutions"]["gemini_gemini-3.1-pro-preview_vanillux"]
    assert (sol["num_runs"], sol["num_success"]) == (8, 3) and sol["pass_at_k"]["1"] == pytest.approx(3 / 8)
    assert list(meta["solutions"]) == ["gemini_gemini-3.1-pro-preview_vanillux"]  # the empty summary.json is skipped
    rep = run_json("report", str(tmp_path))
    hist = rep["success_rate"]["gemini_gemini-3.1-pro-preview_vanillux"]
    assert hist["tasks"] == 1 and hist["counts"][3] == 1 and hist["n"] == [8, 8]  # 3/8 = 0.375


def test_native_files_line_naming_a_missing_source(tmp_path):
    import shutil

    src = tmp_path / "src" / "task_000009_deadbeef"
    shutil.copytree(DATA / "import" / "native" / "task_000008_1ntr1cat", src)
    (src / "fixtures" / "labels.json").unlink()
    r = runner.invoke(app, ["data", "import", str(src.parent), "-o", str(tmp_path / "out"), "--format", "native",
                            "--json"])
    assert r.exit_code == 1  # nothing imported
    data = json.loads(r.stdout)
    assert data["imported"] == []
    assert "%files line `fixtures/labels.json /opt/labels/labels.json`" in data["errors"]["task_000009_deadbeef"]
    assert not (tmp_path / "out" / "task_000009_deadbeef").exists()


def test_def_without_post_uses_setup_sh_on_the_domain_base():
    docker, files = dockerfile_from_def("Bootstrap: docker\nFrom: ubuntu:22.04\n", "echo hi > /x\n", False,
                                        domain="security")
    assert "RUN bash /tmp/post_install.sh" in docker and "echo hi" in files["post_install.sh"]
    # the delta ran on the domain's shared base: python3 and pytest, plus the domain's tools
    assert "python3" in docker and "pytest" in docker and "nmap" in docker
    assert docker.index("nmap") < docker.index("post_install.sh")
    # A setup.sh delta lacks the standard preamble: the user and its home are put back.
    assert "RUN useradd -m user && chmod -R 777 /home/user\nWORKDIR /home/user\n" in docker


def test_import_refuses_unknown_format(tmp_path):
    r = runner.invoke(app, ["data", "import", str(DATA / "import" / "native"), "-o", str(tmp_path), "--format", "zip"])
    assert r.exit_code == 2 and "unknown format" in r.output


# --- pass@k summaries ----------------------------------------------------------------------

def test_task_summary_unbiased_and_without_infra_errors():
    rows = [TrialRow("t", f"t{i}", TrialScore(o, r)) for i, (o, r) in enumerate(
        [("pass", 1.0), ("fail", 0.0), ("agent_timeout", 1.0), ("fail", 0.0), ("fail", 0.0), ("infra_error", None)])]
    s = task_summary("t", rows, "tmax", "m/x")
    assert (s.num_runs, s.num_success, s.num_infra_errors, s.attempts, s.success_rate) == (5, 2, 1, 6, 0.4)
    assert s.pass_at_k["1"] == pytest.approx(0.4)
    assert s.pass_at_k["2"] == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert s.pass_at_k["4"] == 1.0 and len(s.pass_at_k) == 5


def test_band_filters_on_the_success_rate():
    assert parse_band("0.1:0.9") == (0.1, 0.9)
    for bad in ("0.9:0.1", "x", "0.2", "1:2"):
        with pytest.raises(ValueError):
            parse_band(bad)
    sums = {t: SolveSummary(task=t, num_runs=n, num_success=c)
            for t, (n, c) in {"a": (2, 0), "b": (2, 1), "c": (2, 2), "d": (0, 0), "e": (8, 1)}.items()}
    # b (1 of 2) and e (1 of 8) have pass@k = 1 at k = n; their rates 0.5 and 0.125 are in band
    assert in_band(sums, (0.1, 0.9)) == ["b", "e"]


# --- custom axes -------------------------------------------------------------------------

CUSTOM_AXES = """
verifier_kinds = ["exact_text", "metric_threshold"]
fixture_kinds = ["text_only", "image"]
new_task_complexity = ["hard"]

[languages]
Python = 1.0

[task_complexity]
easy = "easy task (one command)"
hard = "hard task (many commands)"

[command_complexity]
bash-only = "bash-only (coreutils)"

[domains.security]
skill_types = ["Systems"]
skills = ["a", "b", "c", "d", "e"]
scenarios = ["auditor"]

[domains.debugging]
skill_types = ["Forensics", "Systems"]
skills = ["f", "g", "h", "i", "j"]
scenarios = ["on-call engineer"]
"""


def test_custom_axes_file_drives_sampling_and_balance(tmp_path):
    import random

    from tmax.tasks.corpus.axes import sample_axes

    path = tmp_path / "axes.toml"
    path.write_text(CUSTOM_AXES)
    axes = load_axes(path)
    draws = [sample_axes(random.Random(i), "rl_v2", axes) for i in range(50)]
    assert {d.domain for d in draws} == {"security", "debugging"}
    assert {d.verifier_kind for d in draws} == {"metric_threshold"} and {d.language for d in draws} == {"Python"}
    # report: N = 2 domains here. The corpus has security 3, debugging 2 and data_science 1,
    # which this file does not declare: it is reported apart and the balance is over 3/2
    # (before, 3/2/1 over N = 2 gave 1.375)
    data = run_json("report", str(DATA / "report"), "--axes", str(path))
    h = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    assert data["balance"]["domain"] == pytest.approx(math.exp(h) / 2, abs=1e-5)
    assert data["outside_buckets"]["domain"] == {"data_science": 1}


def test_bad_axes_file_names_the_field(tmp_path):
    path = tmp_path / "axes.toml"
    path.write_text(CUSTOM_AXES.replace('skills = ["a", "b", "c", "d", "e"]', 'skills = ["a"]'))
    r = runner.invoke(app, ["data", "report", str(DATA / "report"), "--axes", str(path)])
    assert r.exit_code == 2 and "domains.security.skills" in r.output


# --- packaging ---------------------------------------------------------------------------

def test_rewriting_a_task_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """A crash while the new task moves in leaves the old task, never no task (before, the
    old directory was deleted first)."""
    import os

    from tmax.tasks.corpus.axes import TaskAxes
    from tmax.tasks.corpus.package import TaskParts, write_task

    parts = TaskParts(name="t", axes=TaskAxes(domain="security", skill_type="Systems"), instruction="first",
                      final_test="def test_x():\n    pass\n", dockerfile="FROM x\n")
    dest = write_task(parts, tmp_path / "t")
    parts.instruction = "second"
    write_task(parts, dest)
    assert (dest / "instruction.md").read_text() == "second\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t"]  # nothing left aside

    real_replace = os.replace

    def crash_on_move_in(src, dst):
        if Path(dst) == dest and ".old-" not in Path(src).name:  # the new task, not the old one coming back
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_move_in)
    parts.instruction = "third"
    with pytest.raises(OSError, match="disk full"):
        write_task(parts, dest)
    assert (dest / "instruction.md").read_text() == "second\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


@pytest.mark.podman
def test_imported_setup_sh_builds_and_runs_on_podman(tmp_path):
    """The setup.sh of an open-instruct task is the image: it runs at build time, before the seeds."""
    import shutil
    import subprocess

    from tmax.sandbox.base_image import image_exists
    from tmax.tasks.task_images import BASE_TAG, ensure_image
    from tmax.tasks.offline import default_config

    if shutil.which("podman") is None or not image_exists(BASE_TAG):
        pytest.skip("needs podman and the base image")
    src = tmp_path / "src"
    shutil.copytree(DATA / "import" / "open-instruct" / "oi_0003", src / "oi_0003")
    run_json("import", str(src), "-o", str(tmp_path / "out"), "--format", "open-instruct")
    image = ensure_image(Task.load(tmp_path / "out" / "oi_0003"), default_config())
    try:
        out = subprocess.run(["podman", "run", "--rm", image.tag, "bash", "-c",
                              "cat /workspace/logs/setup.txt /workspace/users.txt; id -u user; pwd"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[:3] == ["seeded", "by", "setup"] and "alice" in out.stdout
        assert out.stdout.strip().endswith("/workspace")
    finally:
        subprocess.run(["podman", "rmi", "-f", image.tag], capture_output=True, timeout=120)


@pytest.mark.podman
def test_imported_harbor_task_builds_as_it_was_written(tmp_path):
    import shutil
    import subprocess

    from tmax.sandbox.base_image import image_exists
    from tmax.tasks.task_images import BASE_TAG, ensure_image
    from tmax.tasks.offline import default_config

    if shutil.which("podman") is None or not image_exists(BASE_TAG):
        pytest.skip("needs podman and the base image")
    run_json("import", str(DATA / "import" / "harbor"), "-o", str(tmp_path), "--format", "harbor")
    image = ensure_image(Task.load(tmp_path / "task_000001_ab12cd34"), default_config())
    try:
        out = subprocess.run(["podman", "run", "--rm", image.tag, "bash", "-c", "id -un user; pwd"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["user", "/home/user"]
    finally:
        subprocess.run(["podman", "rmi", "-f", image.tag], capture_output=True, timeout=120)


@pytest.mark.podman
def test_imported_dataset_row_builds_on_its_mapped_image(tmp_path):
    """A dataset row's env_config.image is the task's image: offline it is not pulled, so it is
    built from the row's FROM through --image-map, with the folder's seeds in /workspace."""
    import shutil
    import subprocess

    from tmax.sandbox.base_image import image_exists
    from tmax.tasks.task_images import BASE_TAG, ensure_image
    from tmax.tasks.offline import default_config

    if shutil.which("podman") is None or not image_exists(BASE_TAG):
        pytest.skip("needs podman and the base image")
    run_json("import", str(DATA / "import" / "open-instruct"), "-o", str(tmp_path), "--format", "open-instruct")
    task = Task.load(tmp_path / "oi_0001")
    assert task.config.environment.docker_image == "registry.example.org/tmax/oi_0001:v2"
    image = ensure_image(task, default_config([f"registry.example.org/tmax/*={BASE_TAG}"]))
    try:
        assert image.built and image.workdir == "/workspace"
        out = subprocess.run(["podman", "run", "--rm", image.tag, "bash", "-c", "cat numbers.txt; pwd"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        expected = (DATA / "import" / "open-instruct" / "oi_0001" / "environment" / "seeds" / "numbers.txt")
        assert out.stdout == expected.read_text() + "/workspace\n"
    finally:
        subprocess.run(["podman", "rmi", "-f", image.tag], capture_output=True, timeout=120)


@pytest.mark.podman
@pytest.mark.slow  # the base layer's apt + pip install: about 90 s on a loaded 2-core machine
def test_imported_native_task_builds_with_its_base_layer_and_files_destinations(tmp_path):
    """The native layout through the image path bench and validate use: the shared base layer
    under the task's own steps, %files at their destinations, the setup.sh delta, the user.
    The fixture's intricate layer (torch, ffmpeg, postgresql... several GB) is too big for a
    test; the same fixture as a setup.sh delta on the common + data_querying base is built."""
    import shutil
    import subprocess

    from tmax.sandbox.base_image import image_exists
    from tmax.tasks.task_images import BASE_TAG, ensure_image
    from tmax.tasks.offline import default_config

    if shutil.which("podman") is None or not image_exists(BASE_TAG):
        pytest.skip("needs podman and the base image")
    src = tmp_path / "src" / "task_000010_0de17a00"
    shutil.copytree(DATA / "import" / "native" / "task_000008_1ntr1cat", src)
    meta = json.loads((src / "task.json").read_text())
    meta.update(name=src.name, domain="data_querying", base_image="default")
    (src / "task.json").write_text(json.dumps(meta))
    d = (src / "container.def").read_text()
    (src / "container.def").write_text(d[:d.index("%post")])  # no %post: setup.sh is the delta
    (src / "setup.sh").write_text("sqlite3 /opt/labels/labels.db 'create table t(x); insert into t values (3);'\n")
    run_json("import", str(src.parent), "-o", str(tmp_path / "out"), "--format", "native")
    image = ensure_image(Task.load(tmp_path / "out" / src.name), default_config())
    try:
        probe = ("python3 -m pytest --version >/dev/null && jq -r .CAT /opt/labels/labels.json && "
                 "sqlite3 /opt/labels/labels.db 'select x from t' && test -s /app/fixtures/img.png && "
                 "test ! -e /app/fixtures/labels.json && id -un user && echo $LC_ALL && pwd")
        out = subprocess.run(["podman", "run", "--rm", image.tag, "bash", "-c", probe],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.split() == ["3", "3", "user", "C.UTF-8", "/home/user"]
    finally:
        subprocess.run(["podman", "rmi", "-f", image.tag], capture_output=True, timeout=120)


# --- export / import of datasets -----------------------------------------------------------

def test_export_and_import_round_trip_byte_for_byte(tmp_path):
    """hf and parquet rows rebuild every task byte for byte (executable bits included); the
    tarball holds the same directories."""
    import tarfile

    pytest.importorskip("datasets")
    from tmax.tasks.task_format import tree_hash

    src = DATA / "validate"
    names = ["good", "no-solution", "nop-passes"]
    corpus = tmp_path / "corpus"
    import shutil

    for n in names:
        shutil.copytree(src / n, corpus / n)
    (corpus / "good" / "environment" / "files" / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (corpus / "good" / "solution" / "solve.sh").chmod(0o755)
    want = {n: tree_hash(corpus / n) for n in names}
    for fmt, out, spec in (("hf", tmp_path / "ds", "hf:{}"), ("parquet", tmp_path / "c.parquet", "parquet:{}")):
        data = run_json("export", str(corpus), "-o", str(out), "--format", fmt)
        assert data["exported"] == 3
        back = run_json("import", spec.format(out), "-o", str(tmp_path / f"back-{fmt}"))
        assert sorted(back["imported"]) == names and back["errors"] == {}
        assert {n: tree_hash(tmp_path / f"back-{fmt}" / n) for n in names} == want
    assert os.access(tmp_path / "back-hf" / "good" / "solution" / "solve.sh", os.X_OK)
    row = __import__("datasets").load_from_disk(str(tmp_path / "ds"))[0]
    assert set(row) == {"name", "instruction", "metadata", "files"} and json.loads(row["metadata"])["domain"]
    run_json("export", str(corpus), "-o", str(tmp_path / "c.tar.gz"), "--format", "tar")
    with tarfile.open(tmp_path / "c.tar.gz") as tar:
        tar.extractall(tmp_path / "untar", filter="data")
    assert {n: tree_hash(tmp_path / "untar" / n) for n in names} == want
