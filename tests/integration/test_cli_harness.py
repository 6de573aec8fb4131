"""`tmax run --harness` with the mini-swe and terminus-2 harnesses on the local sandbox (a
real shell, real tmux, a scripted model server), and `tmax show` of the saved run, from its
own files and from ATIF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tmax.agents.atif import write_atif
from scripted_server import ScriptedServer

REPO = Path(__file__).resolve().parents[2]
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def _env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    e.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"), NO_COLOR="1",
             PYTHONPATH=str(REPO), COLUMNS="200")
    return e


def tmax(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", *args], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def run_harness(tmp_path: Path, harness: str, turns: list[dict]) -> tuple[Path, Path, list[dict]]:
    ws, out = tmp_path / "ws", tmp_path / "run"
    ws.mkdir(exist_ok=True)
    with ScriptedServer(turns) as srv:
        proc = tmax(tmp_path, "run", "--json", "--harness", harness, "--env", "local", "--base-url", srv.base_url,
                    "--model", srv.model, "--workdir", str(ws), "-o", str(out), "write the file")
        requests = srv.requests
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout.splitlines()[-1])
    assert done["status"] == "submitted" and done["steps"] == len(turns)
    assert json.loads((out / "run.json").read_text())["harness"] == harness
    return ws, out, requests


def test_unknown_harness_is_a_clear_error(tmp_path):
    proc = tmax(tmp_path, "run", "--json", "--harness", "openhands", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "x")
    assert proc.returncode != 0 and "--harness 'openhands'" in proc.stdout + proc.stderr


def test_mini_swe_runs_each_command_in_a_fresh_process(tmp_path):
    turns = [{"content": f"THOUGHT: step.\n\n```bash\n{c}\n```"} for c in ("cd /tmp", "pwd > where.txt", SUBMIT)]
    ws, out, requests = run_harness(tmp_path, "mini-swe", turns)
    assert (ws / "where.txt").read_text().strip() == str(ws.resolve())  # the `cd /tmp` did not persist
    assert "tools" not in requests[0]
    assert "<returncode>0</returncode>" in requests[1]["messages"][-1]["content"]

    shown = tmax(tmp_path, "show", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "pwd > where.txt" in shown.stdout and "<returncode>0</returncode>" in shown.stdout
    assert "no valid bash call" not in shown.stdout

    # The same run written as ATIF (trajectory.json; the messages move to messages.json),
    # alone in a directory, shows the same steps.
    write_atif(out, agent_name="mini-swe", agent_version="test", model_name="scripted")
    assert json.loads((out / "messages.json").read_text())[-1]["role"] == "user"
    atif_dir = tmp_path / "atif-only"
    atif_dir.mkdir()
    shutil.copy(out / "trajectory.json", atif_dir / "trajectory.json")
    from_atif = tmax(tmp_path, "show", str(atif_dir))
    assert from_atif.returncode == 0, from_atif.stderr
    assert "pwd > where.txt" in from_atif.stdout and "no valid bash call" not in from_atif.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_terminus_drives_a_tmux_session_and_confirms_completion(tmp_path):
    def keys(k: list[str], done: bool = False) -> dict:
        return {"content": json.dumps({"analysis": "a", "plan": "p", "task_complete": done,
                                       "commands": [{"keystrokes": s, "duration": 0.3} for s in k]})}

    turns = [{"content": "not json at all"}, keys(["cd sub\n", "echo term > t.txt\n"]), keys([], True), keys([], True)]
    (tmp_path / "ws" / "sub").mkdir(parents=True)
    ws, out, requests = run_harness(tmp_path, "terminus-2", turns)
    assert (ws / "sub" / "t.txt").read_text() == "term\n"  # the terminal kept the `cd`
    last = [m["content"] for m in requests[-1]["messages"] if m["role"] == "user"]
    assert "parsing errors" in last[1]
    assert any("Are you sure" in t for t in last)
    assert any("echo term > t.txt" in t for t in last)


# --------------------------------------------------------------------------- every harness in every sandbox
def _keys(k: list[str], done: bool = False) -> dict:
    return {"content": json.dumps({"analysis": "a", "plan": "p", "task_complete": done,
                                   "commands": [{"keystrokes": s, "duration": 0.5} for s in k]})}


def _bash_block(command: str) -> dict:
    return {"content": f"THOUGHT: next.\n\n```bash\n{command}\n```"}


# Per harness: the turns (write a file, then show it and where the shell stands) and what the
# second observation must hold. tmax and terminus-2 keep a shell (or terminal) for the whole
# run, so the `cd` of the first step holds in the second; mini-swe starts a process per command.
MATRIX_TURNS = {
    "tmax": ([{"bash": "mkdir -p sub && cd sub && echo matrix-ok > t.txt"}, {"bash": "cat t.txt; pwd"}, {"bash": SUBMIT}],
             ["matrix-ok", "/sub"]),
    "mini-swe": ([_bash_block("mkdir -p sub && echo matrix-ok > sub/t.txt"), _bash_block("cat sub/t.txt; pwd"),
                  _bash_block(SUBMIT)], ["matrix-ok"]),
    "terminus-2": ([_keys(["mkdir -p sub && cd sub && echo matrix-ok > t.txt\n"]), _keys(["cat t.txt; pwd\n"]),
                    _keys([], True), _keys([], True)], ["matrix-ok", "/sub"]),
}
SANDBOXES = [
    "local",
    pytest.param("bwrap", marks=[pytest.mark.bwrap, pytest.mark.skipif(shutil.which("bwrap") is None, reason="no bubblewrap")]),
    pytest.param("podman", marks=[pytest.mark.podman, pytest.mark.skipif(shutil.which("podman") is None, reason="no podman")]),
]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize("harness", list(MATRIX_TURNS))
def test_every_harness_runs_in_every_sandbox(tmp_path, harness, sandbox, request):
    """terminus-2 used to stop at its first step in bwrap: each step's tmux ran in a jail of its
    own, which took the tmux server with it."""
    turns, expected = MATRIX_TURNS[harness]
    ws = tmp_path / "ws"
    ws.mkdir()
    where = ["--workdir", "/tmp"] if sandbox == "podman" else ["--workdir", str(ws)]
    if sandbox == "podman":
        where += ["--image", request.getfixturevalue("base_image")]
    with ScriptedServer(turns) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "tmax.cli.main", "run", "--json", "--harness", harness, "--env", sandbox, *where,
             "--mode", "yolo", "--base-url", srv.base_url, "--model", srv.model, "-o", str(tmp_path / "run"), "go"],
            env=_env(tmp_path), capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert events[-1]["status"] == "submitted" and events[-1]["steps"] == len(turns)
    second = [e for e in events if e["type"] == "observation"][1]["observation"]
    for text in expected:
        assert text in second, (text, second)
