"""benchmarks/results_log.py: a benchmark's `--record` appends its result as one JSON line
(date, commit, machine, argv) to docs/results/<benchmark>.jsonl, whole even with writers side
by side, and whether or not `--json` was given."""

import ast
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.results_log import RESULTS_DIR, make_record, read_records  # noqa: E402
from tmax.agents.policy import TokenTrace  # noqa: E402
from tmax.common.files import append_line_atomic  # noqa: E402
from tmax.training.rollout import Rollout  # noqa: E402


def _append_many(path: str, writer: int, n: int, size: int) -> None:
    for i in range(n):
        append_line_atomic(Path(path), json.dumps({"writer": writer, "i": i, "pad": chr(97 + writer) * size}))


def test_writers_side_by_side_never_interleave_their_lines(tmp_path):
    """Six processes append 30 lines of 256 KiB each (far over a pipe's or a page's size, so a
    line written in pieces would be cut into by the others): every line comes back whole."""
    path = tmp_path / "results" / "bench.jsonl"  # the directory does not exist yet
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), w, 30, 256 * 1024)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 180
    assert all(r["pad"] == chr(97 + r["writer"]) * 256 * 1024 for r in rows)
    for w in range(6):  # each writer's lines in its own order
        assert [r["i"] for r in rows if r["writer"] == w] == list(range(30))


def test_a_line_cut_short_by_a_crash_spoils_only_itself(tmp_path):
    path = tmp_path / "bench.jsonl"
    rec = make_record("bench", {"x": 1}, ["benchmarks/bench.py", "--record"])
    append_line_atomic(path, rec.model_dump_json())
    with open(path, "a") as f:
        f.write('{"benchmark": "bench", "da')  # a writer killed mid-line (not through append_line_atomic)
    append_line_atomic(path, rec.model_dump_json())
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == '{"benchmark": "bench", "da' and lines[2] == lines[0]
    with pytest.raises(ValueError, match=r"bench\.jsonl:2: not a result record"):
        read_records(path)


def test_a_record_names_the_benchmark_commit_machine_and_command(tmp_path):
    argv = ["benchmarks/nano_recipe.py", "--seed", "0", "--record"]
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    rec = make_record("nano_recipe", {"gain_points": 43.0, "stage_seconds": {"rl": 168.0}}, argv)
    after = datetime.datetime.now(datetime.UTC)
    assert rec.benchmark == "nano_recipe" and rec.argv == argv
    assert before <= datetime.datetime.fromisoformat(rec.date) <= after
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert rec.commit == head.stdout.strip() and len(rec.commit) == 40
    m = rec.machine
    assert m.cores == os.cpu_count() and m.cpu_model and 0.1 < m.memory_gib < 1e5 and len(m.load_average) == 3
    path = tmp_path / "nano_recipe.jsonl"
    append_line_atomic(path, rec.model_dump_json())
    assert read_records(path) == [rec]
    assert RESULTS_DIR == REPO / "docs" / "results"


def _run_dir(path: Path, ids: list[int]) -> Path:
    path.mkdir()
    trace = TokenTrace(prompt_ids=[1, 2], ids=ids, logprobs=[0.0] * len(ids), mask=[1] * len(ids), turn_versions=[0])
    r = Rollout(task_id="t1", group_id=0, sample_index=0, seed=0, trace=trace, reward=1.0, status="submitted",
                steps=1, policy_version=0)
    (path / "rollouts.jsonl").write_text(r.to_json() + "\n")
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "model_step_mean": 0.0, "model_step_min": 0.0}) + "\n")
    return path


def test_record_without_json_still_records_what_json_prints(tmp_path):
    """A real benchmark (run_divergence, on two one-episode runs): with --json it prints the
    object and records it; without --json it prints its text and records the same object."""
    a, b = _run_dir(tmp_path / "a", [5, 6]), _run_dir(tmp_path / "b", [5, 6])
    script = str(REPO / "benchmarks" / "run_divergence.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for extra in (["--json"], []):
        argv = [script, str(a), str(b), "--record", "--record-dir", str(tmp_path / "results"), *extra]
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "recorded in" in r.stderr
        runs.append((argv, r.stdout))
    printed = json.loads(runs[0][1])
    assert "token-identical" in runs[1][1] and not runs[1][1].startswith("{")
    records = read_records(tmp_path / "results" / "run_divergence.jsonl")
    assert [rec.argv for rec in records] == [argv for argv, _ in runs]
    assert records[0].result == records[1].result == printed
    assert printed["identical_by_version"] == {"0": {"episodes": 1, "identical": 1}}
    shared = RESULTS_DIR / "run_divergence.jsonl"  # --record-dir kept the scratch runs out of it
    assert not shared.exists() or not any(str(tmp_path) in " ".join(rec.argv) for rec in read_records(shared))


def test_every_benchmark_with_json_takes_record():
    """Each script under benchmarks/ that prints a --json result (and gpu_check, whose last line
    is one) adds --record to its parser and records its result."""
    missing = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        text = path.read_text()
        if path.name == "results_log.py" or ('"--json"' not in text and path.name != "gpu_check.py"):
            continue
        called = {n.func.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if not {"add_record_arguments", "record_result"} <= called:
            missing.append(path.name)
    assert not missing, f"benchmarks without --record: {missing}"


def test_plots_take_in_the_runs_recorded_since(tmp_path):
    """benchmarks/results_plots.py: a nano or nano-podman recipe run recorded with --record
    joins the transcribed runs (a LoRA run is another recipe), and both PNGs are drawn."""
    from benchmarks.results_plots import nano_runs

    figures = json.loads((RESULTS_DIR / "notebook-figures.json").read_text())
    result = {"seed": 4, "sft_pass_rate": 0.3, "rl_pass_rate": 0.8, "minutes_total": 7.0}
    for argv in (["benchmarks/nano_recipe.py", "--seed", "4", "--record"],
                 ["benchmarks/nano_recipe.py", "--config", "tmax/training/configs/nano-podman.toml", "--record"],
                 ["benchmarks/nano_recipe.py", "--config", "tmax/training/configs/nano-lora.toml", "--record"]):
        append_line_atomic(tmp_path / "nano_recipe.jsonl", make_record("nano_recipe", result, argv).model_dump_json())
    runs = nano_runs(figures, tmp_path)
    assert len(runs) == len(figures["nano_recipe_runs"]) + 2
    assert [(r["sandbox"], r["seed"], r["rl_heldout"]) for r in runs[-2:]] == [("host", 4, 0.8), ("podman", 4, 0.8)]
    out = tmp_path / "png"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "results_plots.py"), "--out", str(out),
                        "--records", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("nano_recipe_heldout.png", "collapse_guard.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 10_000
