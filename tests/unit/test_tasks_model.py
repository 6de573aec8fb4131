"""Harbor task loading: valid TB2 tasks load; each kind of broken task gets its own error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tmax.tasks.dataset import DatasetError, load_tasks, resolve, select
from tmax.tasks.task_format import Task, TaskError, UnsupportedTask, parse_size_mb

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "tb2-sample"
GOOD = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"


def make_task(tmp_path: Path, name: str = "t") -> Path:
    dst = tmp_path / name
    shutil.copytree(GOOD, dst)
    return dst


def test_tb2_schema_loads():
    if not SAMPLE.is_dir():
        pytest.skip("tb2 sample not present")
    t = Task.load(SAMPLE / "overfull-hbox")
    env = t.config.environment
    assert (env.cpus, env.memory_mb, env.storage_mb) == (2, 4096, 10240)
    assert t.config.agent.timeout_sec == 750 and t.config.verifier.timeout_sec == 360
    assert env.docker_image == "alexgshaw/overfull-hbox:20251031"
    assert t.category == "debugging" and t.config.version == "1.0"
    assert t.instruction.strip()


def test_all_sample_tasks_load():
    if not SAMPLE.is_dir():
        pytest.skip("tb2 sample not present")
    tasks = load_tasks(SAMPLE)
    assert len(tasks) == 36
    assert all(t.config.environment.memory_mb in (2048, 4096) for t in tasks)
    assert all(t.config.agent.user is None and t.config.verifier.user is None for t in tasks)  # root, as before


def test_newer_schema_fields(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").write_text('schema_version = "1.1"\n[environment]\nmemory_mb = 3000\nstorage_mb = 5000\n'
                                 'allow_internet = false\n[agent]\ntimeout_sec = 30\n')
    t = Task.load(d)
    assert t.config.schema_version == "1.1"
    assert t.config.environment.memory_mb == 3000 and t.config.environment.storage_mb == 5000
    assert t.config.environment.allow_internet is False


def test_agent_and_verifier_users(tmp_path):
    d = make_task(tmp_path)
    assert Task.load(d).config.agent.user is None  # the image's USER
    (d / "task.toml").write_text('[agent]\nuser = "user"\n[verifier]\nuser = 1000\n')
    cfg = Task.load(d).config
    assert (cfg.agent.user, cfg.verifier.user) == ("user", "1000")  # Harbor allows a name or a UID
    (d / "task.toml").write_text('[agent]\nuser = ""\n')
    msg = _err(d)
    assert "task.toml: [agent] user:" in msg and "not an empty string" in msg


@pytest.mark.parametrize("value,mb", [("2G", 2048), ("512M", 512), ("4Gi", 4096), (1024, 1024), ("1.5G", 1536)])
def test_sizes(value, mb):
    assert parse_size_mb(value) == mb


def _err(d: Path) -> str:
    with pytest.raises(TaskError) as ei:
        Task.load(d)
    return str(ei.value)


def test_missing_task_toml(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").unlink()
    assert "task.toml: missing" in _err(d)


def test_bad_toml_syntax(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").write_text("[agent\ntimeout_sec = 1\n")
    assert "task.toml: invalid TOML" in _err(d)


def test_bad_field_type_names_field(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").write_text('[agent]\ntimeout_sec = "soon"\n')
    msg = _err(d)
    assert "task.toml: [agent] timeout_sec:" in msg and "number" in msg


def test_negative_timeout(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").write_text("[verifier]\ntimeout_sec = -5\n")
    assert "[verifier] timeout_sec" in _err(d)


def test_bad_memory_string(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").write_text('[environment]\nmemory = "lots"\n')
    msg = _err(d)
    assert "[environment] memory" in msg and "'lots'" in msg


def test_missing_instruction(tmp_path):
    d = make_task(tmp_path)
    (d / "instruction.md").unlink()
    assert "instruction.md: missing" in _err(d)


def test_empty_instruction(tmp_path):
    d = make_task(tmp_path)
    (d / "instruction.md").write_text("  \n")
    assert "instruction.md: empty" in _err(d)


def test_missing_dockerfile(tmp_path):
    d = make_task(tmp_path)
    (d / "environment" / "Dockerfile").unlink()
    assert "environment/Dockerfile: missing" in _err(d)


def test_missing_test_sh(tmp_path):
    d = make_task(tmp_path)
    (d / "tests" / "test.sh").unlink()
    assert "tests/test.sh: missing" in _err(d)


def test_solution_without_solve_sh(tmp_path):
    d = make_task(tmp_path)
    (d / "solution" / "solve.sh").unlink()
    assert "solution/solve.sh: missing" in _err(d)


def test_compose_refused(tmp_path):
    d = make_task(tmp_path)
    (d / "environment" / "docker-compose.yaml").write_text("services:\n  main:\n    build: .\n")
    with pytest.raises(UnsupportedTask, match="docker-compose environments are not supported"):
        Task.load(d)


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "a task is a directory" in _err(f)


def test_dataset_reports_every_broken_task(tmp_path):
    make_task(tmp_path, "a")
    b = make_task(tmp_path, "b")
    c = make_task(tmp_path, "c")
    (b / "instruction.md").unlink()
    (c / "tests" / "test.sh").unlink()
    with pytest.raises(DatasetError) as ei:
        load_tasks(tmp_path)
    assert "2 task(s)" in str(ei.value) and "b/instruction.md" in str(ei.value) and "c/tests/test.sh" in str(ei.value)
    assert [t.name for t in load_tasks(tmp_path, include=["a"])] == ["a"]


def test_registry_name_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("TMAX_DATASETS_DIR", str(tmp_path / "cache"))
    with pytest.raises(DatasetError, match="terminal-bench@2.0 is not in the local cache.*cannot download"):
        resolve("terminal-bench@2.0")
    (tmp_path / "cache" / "terminal-bench@2.0").mkdir(parents=True)
    make_task(tmp_path / "cache" / "terminal-bench@2.0", "x")
    assert [t.name for t in load_tasks("terminal-bench@2.0")] == ["x"]


def test_select_filters():
    names = ["a-1", "a-2", "b-1", "c"]
    assert select(names, ["a-*"]) == ["a-1", "a-2"]
    assert select(names, None, ["a-*"]) == ["b-1", "c"]
    assert select(names, ["*-1", "c"], ["b*"], limit=1) == ["a-1"]
