"""The nano task generator: Harbor layout, split disjointness, oracle vs untouched state.

Verifiers run for real with bash in temp work dirs (the way the local sandbox runs them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import tomli_w

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.common.records import NanoMeta
from tmax.tasks.hostenv import check_dockerfile, populate
from tmax.tasks.task_format import Task
from tmax.training.nano import tasks as T

N_TRAIN, N_HELDOUT = 60, 30


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("nano-tasks")
    return out, T.write_splits(out, N_TRAIN, N_HELDOUT, seed=3)


def _values(params: dict) -> set:
    return {str(v) for v in params.values()}


def _file_words(task: T.NanoTask) -> set[str]:
    return {w for text in task.files.values() for w in text.split()}


def test_splits_written_in_harbor_layout(written):
    out, dirs = written
    assert len(dirs["train"]) == N_TRAIN and len(dirs["heldout"]) == N_HELDOUT
    for d in dirs["train"] + dirs["heldout"]:
        for f in ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh", "solution/solve.sh"):
            assert (d / f).is_file(), d / f
        assert os.access(d / "tests/test.sh", os.X_OK)
        cfg = tomllib.loads((d / "task.toml").read_text())
        assert cfg["version"] == "1.0" and cfg["verifier"]["timeout_sec"] > 0
        dockerfile = (d / "environment/Dockerfile").read_text()
        assert dockerfile.startswith(f"FROM {T.BASE_IMAGE}\nWORKDIR /app\n")
        if any((d / "environment/files").iterdir()):
            assert "COPY files/ ./" in dockerfile


def test_task_loader_accepts_generated_tasks(written):
    model = pytest.importorskip("tmax.tasks.task_format")
    _, dirs = written
    task = model.Task.load(dirs["heldout"][0])
    assert task.instruction.strip() and task.config.verifier.timeout_sec == 30.0
    assert task.config.environment.allow_internet is False


def test_every_kind_in_both_splits():
    for split in T.SPLITS:
        kinds = {t.kind for t in T.generate(split, len(T.KINDS), 0)}
        assert kinds == set(T.KINDS)


def test_heldout_parameters_never_occur_in_train():
    train = T.generate("train", 500, seed=0)
    heldout = T.generate("heldout", 200, seed=0)
    train_params = set().union(*(_values(t.params) for t in train))
    train_text = set().union(*(_file_words(t) for t in train))
    for t in heldout:
        assert not (_values(t.params) & train_params), (t.name, _values(t.params) & train_params)
        assert not (_file_words(t) & train_text), t.name
        stems = {str(v).split(".")[0] for k, v in t.params.items() if isinstance(v, str)}
        assert not any(s in c for s in stems for tt in train for c in tt.commands), t.name
    # Numbers too: held-out counts and sizes are outside the train range.
    train_numbers = {v for t in train for v in t.params.values() if isinstance(v, int)}
    heldout_numbers = {v for t in heldout for v in t.params.values() if isinstance(v, int)}
    assert heldout_numbers and not (heldout_numbers & train_numbers)


def test_generation_is_deterministic_and_seeded():
    a = [(t.instruction, t.files) for t in T.generate("train", 20, seed=5)]
    b = [(t.instruction, t.files) for t in T.generate("train", 20, seed=5)]
    c = [(t.instruction, t.files) for t in T.generate("train", 20, seed=6)]
    assert a == b and a != c


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="unknown split"):
        T.generate("test", 3)
    with pytest.raises(ValueError, match="unknown nano task kind 'rename'"):
        T.generate("train", 3, kinds=["rename"])


def _verify(task_dir: Path, work: Path, logs: Path) -> tuple[float | None, str]:
    """Run tests/test.sh as the local sandbox would: tests copied elsewhere, cwd = work."""
    r = subprocess.run(
        ["bash", str(task_dir / "tests" / "test.sh")],
        cwd=work,
        env={**os.environ, "TMAX_LOGS_DIR": str(logs)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    reward = logs / "verifier" / "reward.txt"
    return (float(reward.read_text()) if reward.is_file() else None), r.stdout + r.stderr


def _fresh(task_dir: Path, root: Path) -> tuple[Path, Path]:
    work, logs = root / "work", root / "logs"
    work.mkdir(parents=True)
    task = Task.load(task_dir)
    populate(task, check_dockerfile(task), work)  # what the image's COPY does, on the host
    return work, logs


@pytest.mark.parametrize("split", T.SPLITS)
def test_oracle_passes_and_untouched_state_fails(written, tmp_path, split):
    _, dirs = written
    for i, task_dir in enumerate(dirs[split]):
        # Untouched: the seed files alone score 0.
        work, logs = _fresh(task_dir, tmp_path / f"{i}-nop")
        reward, out = _verify(task_dir, work, logs)
        assert reward == 0.0, (task_dir.name, out)
        # Oracle, as an agent would run it: one command at a time in a shell in the work dir.
        work, logs = _fresh(task_dir, tmp_path / f"{i}-oracle")
        commands = T.oracle_commands(task_dir)
        assert commands[-1] == SUBMIT_COMMAND
        script = "\n".join(commands) + "\n"
        r = subprocess.run(["bash", "-e"], input=script, cwd=work, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (task_dir.name, r.stderr)
        reward, out = _verify(task_dir, work, logs)
        assert reward == 1.0, (task_dir.name, commands, out)


def test_solve_sh_passes_with_explicit_workdir(written, tmp_path):
    """solution/solve.sh (Harbor's oracle agent) and TMAX_WORKDIR, verifier run from elsewhere."""
    _, dirs = written
    for task_dir in dirs["heldout"][: len(T.KINDS)]:
        work, logs = _fresh(task_dir, tmp_path / task_dir.name)
        subprocess.run(["bash", str(task_dir / "solution/solve.sh")], cwd=work, check=True, timeout=30)
        r = subprocess.run(
            ["bash", str(task_dir / "tests/test.sh")],
            cwd=tmp_path,
            env={**os.environ, "TMAX_LOGS_DIR": str(logs), "TMAX_WORKDIR": str(work)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (logs / "verifier/reward.txt").read_text().strip() == "1", r.stdout


def test_wrong_answers_fail(written, tmp_path):
    """Near misses score 0: a wrong count, the input unchanged, a confusable kind's command."""
    _, dirs = written
    by_kind = {}
    for d in dirs["train"]:
        by_kind.setdefault(NanoMeta.read(d).kind, d)
    wrong = {
        "count_lines": "echo 999 > answer.txt",
        "count_words": "wc -l < *.dat > answer.txt",
        "sort": "cp *.dat answer.txt",
        "upper": "cp *.dat answer.txt",
        "unique": "sort *.dat > answer.txt",
        "reverse": "sort -r *.dat > answer.txt",
        "first": "tail -n 1 *.dat > answer.txt",
        "last": "head -n 1 *.dat > answer.txt",
    }
    assert set(wrong) == set(T.KINDS)
    for kind, command in wrong.items():
        d = by_kind[kind]
        work, logs = _fresh(d, tmp_path / kind)
        subprocess.run(["bash", "-c", command], cwd=work, check=True)
        reward, out = _verify(d, work, logs)
        assert reward == 0.0, (kind, out)


def test_oracle_commands_depend_on_kind_only():
    """The learnable part: one command per kind, and no held-out parameter in any command."""
    for split in T.SPLITS:
        by_kind: dict[str, set] = {}
        for t in T.generate(split, 80, seed=1):
            by_kind.setdefault(t.kind, set()).add(tuple(t.commands))
            assert t.params["src"] in t.instruction and t.params["src"] not in " ".join(t.commands)
        assert all(len(v) == 1 for v in by_kind.values()), by_kind


def test_oracle_steps_have_thoughts(written):
    _, dirs = written
    steps = T.oracle_steps(dirs["train"][0])
    assert [c for _, c in steps] == T.oracle_commands(dirs["train"][0])
    assert all(t.startswith("THOUGHT: ") for t, _ in steps)
    with pytest.raises(ValueError, match="not a generated nano task"):
        bad = dirs["train"][0].parent / "plain"
        bad.mkdir()
        (bad / "task.toml").write_text('version = "1.0"\n')
        T.oracle_commands(bad)


def test_metadata_table_as_written_and_as_older_versions_wrote_it(written, tmp_path):
    """A one-command task's `[metadata.nano]` table holds no long-family fields, and a task
    written before `family`, `depth` and `thoughts` were recorded still reads: family nano,
    depth 1, and its oracle steps take the kind's THOUGHT."""
    from tmax.training.agentic import task_depth

    _, dirs = written
    table = tomllib.loads((dirs["train"][0] / "task.toml").read_text())["metadata"]["nano"]
    assert set(table) == {"kind", "split", "commands", "params", "family", "depth"}
    old = tmp_path / "old"
    shutil.copytree(dirs["train"][0], old)
    doc = tomllib.loads((old / "task.toml").read_text())
    for key in ("family", "depth"):
        del doc["metadata"]["nano"][key]
    (old / "task.toml").write_text(tomli_w.dumps(doc))
    meta = NanoMeta.read(old)
    assert (meta.family, meta.depth, meta.thoughts) == ("nano", 1, []) and task_depth(old) == 1
    assert T.oracle_steps(old) == T.oracle_steps(dirs["train"][0])
    doc["metadata"]["nano"]["commands"] = "not a list"
    (old / "task.toml").write_text(tomli_w.dumps(doc))
    with pytest.raises(ValueError, match=r"\[metadata.nano\] is not a NanoMeta record"):
        NanoMeta.read(old)
    assert task_depth(old) is None


def test_teacher_slips_fail_every_kind_and_accuracy_is_its_rate(written, tmp_path):
    """Every slip of the imperfect teacher breaks the oracle command of every kind (the
    verifier scores 0), the THOUGHT stays the oracle's, and slips happen at 1 - accuracy."""
    import random

    _, dirs = written
    for i, d in enumerate(dirs["train"][: len(T.KINDS)]):
        oracle = T.oracle_steps(d)
        for j, (old, new) in enumerate(T._SLIPS):
            assert old in oracle[0][1]
            work, logs = _fresh(d, tmp_path / f"{i}-{j}")
            subprocess.run(["bash", "-c", oracle[0][1].replace(old, new, 1)], cwd=work, capture_output=True)
            reward, out = _verify(d, work, logs)
            assert reward == 0.0, (d.name, new, out)
    rng = random.Random(0)
    draws = [T.teacher_steps(dirs["train"][0], 0.4, rng) for _ in range(2000)]
    right = [steps for steps, ok in draws if ok]
    assert all(steps == T.oracle_steps(dirs["train"][0]) for steps in right)
    assert 0.36 < len(right) / len(draws) < 0.44
    slipped = [steps for steps, ok in draws if not ok]
    assert all(s[0][0] == T.oracle_steps(dirs["train"][0])[0][0] and s[0][1] != T.oracle_steps(dirs["train"][0])[0][1]
               and s[-1][1] == T.oracle_steps(dirs["train"][0])[-1][1] for s in slipped)
    assert T.teacher_steps(dirs["train"][0], 1.0, rng) == (T.oracle_steps(dirs["train"][0]), True)
    with pytest.raises(ValueError, match="accuracy"):
        T.teacher_steps(dirs["train"][0], 0.0, rng)
