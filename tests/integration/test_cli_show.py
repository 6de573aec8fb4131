"""`tmax show`: a saved run rendered step by step, `--json` passthrough, clear errors.

A run saved by a real `tmax run` is shown in tests/integration/test_cli_run.py; here the files are
written by hand in the documented Vanillux2 record format (trajectory / timing / usage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from documented import documented

SYSTEM = "You are a terminal agent. SYSTEM-PROMPT-TEXT"
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Count the files in /data and [bold]report[/bold]."},
    {
        "role": "assistant",
        "content": "First I look at the directory.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": "ls /data | wc -l"})}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "42\n\n(exit_code=0)"},
    {"role": "assistant", "content": "I will just say it."},
    {"role": "user", "content": "Format error: Your last response did not include a valid `bash` tool call."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": "cat /missing"})}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": "cat: /missing: No such file or directory\n\n(exit_code=1)"},
]
TIMING = [
    {"step": 1, "llm_s": 1.2, "bash_s": 0.1, "return_code": 0, "cmd": "ls /data | wc -l"},
    {"step": 2, "llm_s": 0.8, "format_error": True},
    {"step": 3, "llm_s": 0.5, "bash_s": 0.0, "return_code": 1, "cmd": "cat /missing"},
]
USAGE = {"prompt_tokens": 12345, "completion_tokens": 678, "total_tokens": 13023, "reasoning_tokens": 0, "cost_usd": 0.0, "max_steps": 64}


def save_run(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "trajectory.json").write_text(json.dumps(MESSAGES, indent=2))
    (d / "timing.json").write_text(json.dumps(TIMING))
    (d / "usage.json").write_text(json.dumps(USAGE))
    return d


def tmax(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "tmax.cli.main", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_show_renders_steps(tmp_path):
    run_dir = save_run(tmp_path / "run")
    proc = tmax("show", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # Steps in order, with thought, command, output and exit code.
    order = [
        "Count the files in /data and [bold]report[/bold].",  # markup in content is shown literally
        "Step 1",
        "First I look at the directory.",
        "ls /data | wc -l",
        "42",
        "exit 0",
        "Step 2",
        "I will just say it.",
        "no valid bash call",
        "Format error",
        "Step 3",
        "cat /missing",
        "No such file or directory",
        "exit 1",
        "3 steps",
        "12.3k prompt",
        "678 completion",
    ]
    pos = 0
    for item in order:
        found = out.find(item, pos)
        assert found >= 0, f"{item!r} missing (or out of order) in:\n{out}"
        pos = found + len(item)
    assert SYSTEM not in out  # the system prompt is only shown with --system
    assert "(exit_code=" not in out  # the exit code is rendered, not echoed raw
    assert SYSTEM in tmax("show", "--system", str(run_dir)).stdout


def test_show_accepts_the_trajectory_file(tmp_path):
    run_dir = save_run(tmp_path / "run")
    proc = tmax("show", str(run_dir / "trajectory.json"))
    assert proc.returncode == 0 and "ls /data | wc -l" in proc.stdout and "12.3k prompt" in proc.stdout


def test_show_json_passthrough(tmp_path):
    run_dir = save_run(tmp_path / "run")
    proc = tmax("show", "--json", str(run_dir))
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert data["trajectory"] == MESSAGES
    assert data["timing"] == TIMING
    assert data["usage"] == USAGE
    assert data["dir"] == str(run_dir)


def test_show_without_timing_or_usage(tmp_path):
    run_dir = tmp_path / "partial"
    run_dir.mkdir()
    (run_dir / "trajectory.json").write_text(json.dumps(MESSAGES[:4]))
    proc = tmax("show", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "Step 1" in proc.stdout and "Step 2" not in proc.stdout


@pytest.mark.parametrize(
    "setup, fragment",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "trajectory.json does not exist"),
        (lambda d: (d.mkdir(), (d / "trajectory.json").write_text("{not json")), "not readable JSON"),
        (lambda d: (d.mkdir(), (d / "trajectory.json").write_text('{"a": 1}')), "not a trajectory"),
        (
            lambda d: (d.mkdir(), (d / "trajectory.json").write_text("[]"), (d / "timing.json").write_text('{"x": 1}')),
            "per-step records",
        ),
    ],
)
def test_show_bad_input(tmp_path, setup, fragment):
    d = tmp_path / "bad"
    setup(d)
    proc = tmax("show", str(d))
    assert proc.returncode == 2
    assert fragment in proc.stderr


def test_show_a_run_saved_by_tmax_run(tmp_path):
    """The files `tmax run` writes render back with the same steps."""
    from scripted_server import ScriptedServer

    ws = tmp_path / "ws"
    ws.mkdir()
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"))
    script = [
        {"content": "Counting words.", "bash": "printf 'a b c\\n' | wc -w"},
        {"bash": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"},
    ]
    with ScriptedServer(script) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "tmax.cli.main", "run", "--json", "--env", "local", "--base-url", srv.base_url,
             "--model", srv.model, "--workdir", str(ws), "-o", str(run_dir), "count the words"],
            capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL,
        )
    assert proc.returncode == 0, proc.stderr
    out = tmax(*documented("tmax show RUN_DIR", RUN_DIR=str(run_dir))[1:]).stdout
    pos = 0
    for item in ("count the words", "Step 1", "Counting words.", "wc -w", "3", "exit 0", "Step 2",
                 "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "submitted", "2 steps", "prompt"):
        found = out.find(item, pos)
        assert found >= 0, f"{item!r} missing (or out of order) in:\n{out}"
        pos = found + len(item)
    data = json.loads(tmax("show", "--json", str(run_dir)).stdout)
    assert data["trajectory"] == json.loads((run_dir / "trajectory.json").read_text())
    assert data["outcome"]["status"] == "submitted" and data["run"]["task"] == "count the words"
