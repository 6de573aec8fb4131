"""tmax reads job directories it did not write: two real Harbor 0.26 wrote with `-e podman`
(tests/data/harbor-job, and tests/data/harbor-job-timeout with agent timeouts the verifier
then scored), one shaped like another agent's (chat messages in agent/trajectory.json,
exception_info without a reward, `metadata: null`, a trial without result.json), and, where
TMAX_PUBLISHED_JOBS names them, the published Terminal-Bench 2.0 jobs Harbor 0.6.6 wrote.
`bench report`, `bench compare` and `show` work on them, score them by the same rule, take
categories from task.toml, and write no chart into them unless told where."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harbor_env import harbor_check

REPO = Path(__file__).resolve().parents[2]
HARBOR_JOB = Path(__file__).parents[1] / "data" / "harbor-job" / "h"
TIMEOUT_JOB = Path(__file__).parents[1] / "data" / "harbor-job-timeout" / "t"
# The original project's evaluation assets (daytona/<model>/terminal-bench-2-0), where present.
PUBLISHED = os.environ.get("TMAX_PUBLISHED_JOBS")
ECHO_TASK = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"


def tmax(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160", NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def harbor_copy(tmp_path: Path, name: str, src: Path = HARBOR_JOB) -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_report_and_compare_count_a_timed_out_agents_pass(tmp_path):
    """Harbor's job with agent timeouts the verifier then scored: report and compare print the
    same pass@1 (the verifier's reward counts), and compare names the agent and its steps."""
    rep = tmax("bench", "report", str(TIMEOUT_JOB), "--json")
    assert rep.returncode == 0, rep.stderr
    data = json.loads(rep.stdout)
    assert (data["pass_at_k"]["1"], data["mean_reward"], data["n_infra_errors"]) == (0.5, 0.5, 0)
    assert data["outcomes"] == {"pass": 2, "agent_timeout": 4, "fail": 2}
    # Harbor's oracle writes no trajectory: give each trial of a copy one (ATIF, 3 agent steps).
    steps = tmp_path / "steps"
    shutil.copytree(TIMEOUT_JOB, steps)
    atif = {"schema_version": "ATIF-v1.6", "session_id": "s", "agent": {"name": "oracle", "version": "1"},
            "steps": [{"step_id": 1, "source": "user", "message": "task"}]
            + [{"step_id": i, "source": "agent", "message": "ok"} for i in (2, 3, 4)]}
    for trial in steps.glob("*__*"):
        (trial / "agent" / "trajectory.json").write_text(json.dumps(atif))
    cmp = tmax("bench", "compare", str(TIMEOUT_JOB), str(steps), "--json")
    assert cmp.returncode == 0, cmp.stderr
    jobs = json.loads(cmp.stdout)["jobs"]
    assert [(j["pass_at_1"], j["agent"], j["n_trials"]) for j in jobs] == [(0.5, "oracle", 8)] * 2
    assert [j["mean_steps"] for j in jobs] == [None, 3.0]
    report_text = tmax("bench", "report", str(TIMEOUT_JOB), "--no-chart").stdout
    compare_text = tmax("bench", "compare", str(TIMEOUT_JOB), str(steps), "--no-chart").stdout
    assert "pass@1 50.00%" in report_text and "50.00%" in compare_text and "oracle" in compare_text
    # `tmax show` of a trial says what it scored, by the same rule.
    (timed_out, *_) = sorted(steps.glob("answer-then-hang__*"))
    shown = tmax("show", str(timed_out))
    assert shown.returncode == 0, shown.stderr
    assert "trial agent_timeout, reward 1" in shown.stdout and "3 steps" in shown.stdout
    assert json.loads(tmax("show", "--json", str(timed_out)).stdout)["trial"]["passed"] is True


@pytest.mark.skipif(not PUBLISHED, reason="TMAX_PUBLISHED_JOBS does not name the published jobs")
def test_published_terminal_bench_jobs():
    """The paper's figures from the jobs Harbor 0.6.6 wrote: 27.19 % (TMax-9B) and 21.12 %
    (Qwen3.5-9B), the same in report and compare, with the agent and its mean steps."""
    dirs = [Path(PUBLISHED) / model / "terminal-bench-2-0" for model in ("tmax-9b", "Qwen3.5-9B")]
    expected = ["27.19%", "21.12%"]
    for d, pct in zip(dirs, expected):
        rep = tmax("bench", "report", str(d), "--no-chart")
        assert rep.returncode == 0, rep.stderr
        assert f"pass@1 {pct}" in rep.stdout and f"mean reward {pct}" in rep.stdout
    cmp = tmax("bench", "compare", *map(str, dirs), "--json", "--no-chart")
    assert cmp.returncode == 0, cmp.stderr
    jobs = json.loads(cmp.stdout)["jobs"]
    assert [f"{j['pass_at_1'] * 100:.2f}%" for j in jobs] == expected
    assert {j["agent"] for j in jobs} == {"vanillux2-agent"} and all(j["mean_steps"] > 1 for j in jobs)
    text = tmax("bench", "compare", *map(str, dirs), "--no-chart").stdout
    assert all(pct in text for pct in expected) and "vanillux2-agent" in text


def test_report_and_compare_on_a_job_real_harbor_wrote(tmp_path):
    job = harbor_copy(tmp_path, "h")
    before = listing(job)
    rep = tmax("bench", "report", str(job), "--json")
    assert rep.returncode == 0, rep.stderr
    data = json.loads(rep.stdout)
    assert (data["n_trials"], data["mean_reward"]) == (2, 0.5)
    assert data["outcomes"] == {"pass": 1, "fail": 1}
    assert data["ci_method"] == "exact Clopper-Pearson"
    assert data["charts"] == [] and listing(job) == before  # nothing written into Harbor's job

    charts = tmp_path / "charts"
    rep = tmax("bench", "report", str(job), "--chart-dir", str(charts))
    assert rep.returncode == 0, rep.stderr
    assert sorted(p.name for p in charts.iterdir()) == ["pass_rate_by_category.png", "pass_rate_by_task.png"]
    assert "exact Clopper-Pearson" in rep.stdout

    # Harbor writes "agent_result": {"metadata": null}; compare once crashed on it.
    other = harbor_copy(tmp_path, "h2")
    cmp = tmax("bench", "compare", str(job), str(other), "--json")
    assert cmp.returncode == 0, cmp.stderr
    comp = json.loads(cmp.stdout)
    assert [j["pass_at_1"] for j in comp["jobs"]] == [0.5, 0.5]
    assert comp["jobs"][0]["agent"] == "oracle"
    assert comp["chart"] is None and listing(job) == before
    assert comp["pairs"][0]["p_value"] == 1.0 and "more than half" in comp["paired_outcome"]
    table = tmax("bench", "compare", str(job), str(other))
    assert table.returncode == 0 and "McNemar exact" in table.stdout and "more than half" in table.stdout
    # tmax cannot rerun Harbor's agents: resume says so instead of failing somewhere inside.
    res = tmax("bench", "resume", str(job))
    assert res.returncode == 2 and "harbor job resume" in " ".join(res.stderr.split()) and listing(job) == before


def test_categories_come_from_the_task_toml_the_trial_names(tmp_path):
    """The same Harbor trials, one with its task where its config says (the category is
    task.toml's), one whose task is gone (no category in its config either)."""
    job = harbor_copy(tmp_path, "h")
    for trial in job.iterdir():
        if trial.is_dir():
            result = json.loads((trial / "result.json").read_text())
            task = ECHO_TASK if trial.name.startswith("echo-hello__") else tmp_path / "gone" / result["task_name"]
            result["config"]["task"]["path"] = str(task)
            (trial / "result.json").write_text(json.dumps(result))
    data = json.loads(tmax("bench", "report", str(job), "--json").stdout)
    assert data["categories"] == {"file-operations": 1.0, "uncategorized": 0.0}


def test_show_on_harbor_trials(tmp_path):
    job = harbor_copy(tmp_path, "h")
    (trial,) = [d for d in job.iterdir() if d.name.startswith("echo-hello__")]
    shown = tmax("show", str(trial))  # Harbor's oracle records no trajectory: a clear error, no traceback
    assert shown.returncode == 2 and "agent/trajectory.json does not exist" in shown.stderr

    # An ATIF trajectory shaped as Harbor's terminus-2 writes it: the model's replies carry no
    # tool calls, the parsed keystrokes are `bash_command` calls, completion a tool call too.
    atif = {
        "schema_version": "ATIF-v1.6", "session_id": "s1",
        "agent": {"name": "terminus-2", "version": "2.0.0", "model_name": "openai/some-model"},
        "steps": [
            {"step_id": 1, "source": "user", "message": "Write hello into /app/hello.txt."},
            {"step_id": 2, "source": "agent", "message": "Analysis: nothing yet.\nPlan: write the file.",
             "tool_calls": [{"tool_call_id": "call_0_1", "function_name": "bash_command",
                             "arguments": {"keystrokes": "echo hello > /app/hello.txt\n", "duration": 0.1}}],
             "observation": {"results": [{"source_call_id": "call_0_1", "content": "root@box:/app# "}]}},
            {"step_id": 3, "source": "agent", "message": "Done.",
             "tool_calls": [{"tool_call_id": "call_1_task_complete", "function_name": "mark_task_complete",
                             "arguments": {}}],
             "observation": {"results": [{"content": "Are you sure?"}]}},
        ],
        "final_metrics": {"total_prompt_tokens": 10, "total_completion_tokens": 5, "total_steps": 3},
    }
    (trial / "agent" / "trajectory.json").write_text(json.dumps(atif))
    shown = tmax("show", str(trial))
    assert shown.returncode == 0, shown.stderr
    assert "echo hello > /app/hello.txt" in shown.stdout and "mark_task_complete" in shown.stdout
    assert "no valid bash call" not in shown.stdout and "Format error" not in shown.stdout
    assert "harness terminus-2" in shown.stdout and "2 steps" in shown.stdout
    loaded = harbor_check(job)  # and Harbor's own Trajectory model takes it as ATIF
    assert loaded["atif"] == 1 and [f for f in loaded["failures"] if "file" in f] == []


def other_agents_job(root: Path) -> Path:
    """A job another agent wrote: a passed trial whose agent/trajectory.json is chat messages,
    one that errored without a reward, and one still without result.json."""
    job = root / "other"
    job.mkdir(parents=True)
    (job / "config.json").write_text(json.dumps({"job_name": "other", "agents": [{"name": "my-agent"}]}))

    def trial(name: str, result: dict | None, messages: list | None = None) -> None:
        d = job / name
        (d / "agent").mkdir(parents=True)
        if result is not None:
            base = {"task_name": name.split("__")[0], "trial_name": name, "agent_result": {"metadata": None},
                    "config": {"task": {"path": str(ECHO_TASK)}}}
            (d / "result.json").write_text(json.dumps({**base, **result}))
        if messages is not None:
            (d / "agent" / "trajectory.json").write_text(json.dumps(messages))

    chat = [{"role": "user", "content": "Write hello."},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "echo hi"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "hi"}]
    trial("echo-hello__a", {"verifier_result": {"rewards": {"reward": 1.0}}}, chat)
    trial("echo-hello__b", {"verifier_result": None, "exception_info": {"exception_type": "RuntimeError",
                                                                         "exception_message": "container died"}})
    trial("echo-hello__c", None, chat)
    return job


def test_reads_another_agents_job(tmp_path):
    job = other_agents_job(tmp_path)
    before = listing(job)
    data = json.loads(tmax("bench", "report", str(job), "--json").stdout)
    assert data["n_trials"] == 2 and data["outcomes"] == {"pass": 1, "infra_error": 1}
    assert data["categories"] == {"file-operations": 0.5}
    cmp = tmax("bench", "compare", str(job), str(job), "--json")
    assert cmp.returncode == 0, cmp.stderr
    j = json.loads(cmp.stdout)["jobs"][0]
    assert (j["agent"], j["n_trials"], j["n_infra_errors"], j["pass_at_1"]) == ("my-agent", 2, 1, 1.0)
    assert listing(job) == before
    shown = tmax("show", str(job / "echo-hello__c"))  # no result.json, chat messages in agent/
    assert shown.returncode == 0, shown.stderr
    assert "echo hi" in shown.stdout


@pytest.mark.podman
def test_overhead_benchmark_runs(tmp_path):
    """benchmarks/bench_overhead.py, once, without Harbor: the figures it promises, from real runs
    (the timing itself is for the benchmark to print, not for a test to judge)."""
    if subprocess.run(["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
        pytest.skip("podman or the base image is missing")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_overhead.py"), "--runs", "1", "--no-harbor",
                           "--json"], capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["tmax_s"] > 0 and out["floor_s"] > 0
    assert out["overhead_s"] == pytest.approx(out["tmax_s"] - out["floor_s"], abs=0.002)
    assert out["harbor_skipped"] == "not asked (--no-harbor)"
    assert not subprocess.run(["podman", "ps", "-a", "-q", "--filter", "label=io.tmax.job=r0"],
                              capture_output=True, text=True).stdout.strip()  # tmax left no container


def test_the_bench_path_imports_no_other_command():
    """`tmax bench` pays for its own imports only: `tmax run`'s config and training stay out
    (sub-commands are imported on first use), and podman-py waits for the first container."""
    code = ("import sys, tmax.cli.main, tmax.cli.bench_cmd, tmax.tasks.job, tmax.tasks.trial, tmax.sandbox.podman; "
            "print(sorted({'.'.join(m.split('.')[:2]) if m.startswith('tmax.training') else m for m in sys.modules "
            "if m.startswith(('tmax.training', 'tmax.cli.run_cmd', 'tmax.cli.serve_cmd', 'tmax.cli.run_settings', 'podman', "
            "'requests'))}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
