"""Each harness solves a small Harbor task through `tmax bench run` on podman with a scripted
model server, and fails it when the script is wrong; every trial also writes ATIF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.podman]

from documented import documented  # noqa: E402
from harbor_env import harbor_check  # noqa: E402
from scripted_server import ScriptedServer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASK = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

if shutil.which("podman") is None or subprocess.run(
        ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
    pytest.skip("podman or the base image is missing", allow_module_level=True)


def _mini(command: str) -> dict:
    return {"content": f"THOUGHT: next step.\n\n```bash\n{command}\n```"}


def _keys(keystrokes: list[str], done: bool = False) -> dict:
    commands = [{"keystrokes": k, "duration": 0.5} for k in keystrokes]
    return {"content": json.dumps({"analysis": "a", "plan": "p", "commands": commands, "task_complete": done})}


def script(harness: str, word: str) -> list[dict]:
    if harness == "tmax":
        return [{"bash": f"cd /app && echo {word} > hello.txt"}, {"bash": SUBMIT}]
    if harness == "mini-swe":
        # No persistent shell: the `cd /tmp` is forgotten and the file lands in the workdir (/app).
        return [_mini("cd /tmp"), _mini(f"echo {word} > hello.txt"), _mini(SUBMIT)]
    # terminus-2: a persistent terminal; the first task_complete asks, the second confirms.
    return [_keys(["cd /app\n", f"echo {word} > hello.txt\n"]), _keys([], done=True), _keys([], done=True)]


def bench(tmp_path: Path, harness: str, srv: ScriptedServer, name: str) -> dict:
    """`tmax bench run` of the task in a directory of its own (`name`), its job under jobs/."""
    here = tmp_path / name
    here.mkdir()
    if name == "mini-swe-hello":  # the page's line as typed, its job jobs/mini
        argv = documented("tmax bench run DS -a mini-swe -m M --base-url URL --job-name mini", DS=str(TASK),
                          M=srv.model, URL=srv.base_url)
    else:
        argv = ["tmax", "bench", "run", str(TASK), "-a", harness, "-m", srv.model, "--base-url", srv.base_url,
                "--job-name", name]
    job = here / "jobs" / argv[-1]
    proc = subprocess.run([sys.executable, "-m", "tmax.cli.main", *argv[1:]], cwd=here, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trial,) = [d for d in job.iterdir() if d.is_dir()]
    return {"dir": trial, "job": job, "result": json.loads((trial / "result.json").read_text())}


def solve(tmp_path: Path, harness: str, word: str, outcome: str) -> Path:
    """One `tmax bench run` of the task with a script that writes `word`, and what its trial
    and `tmax show` of it say (the page's `tmax show jobs/mini/TASK__ID` as typed); its job."""
    turns = script(harness, word)
    with ScriptedServer(turns) as srv:
        trial = bench(tmp_path, harness, srv, f"{harness}-{word}")
        assert len(srv.requests) == len(turns)  # submitted exactly at the end of the script
        first = srv.requests[0]
    r = trial["result"]
    assert r["tmax"]["outcome"] == outcome, r.get("exception_info")
    assert r["agent_result"]["metadata"]["status"] == "submitted"
    assert r["agent_info"]["name"] == harness
    assert ("tools" in first) == (harness == "tmax")
    atif = json.loads((trial["dir"] / "agent" / "trajectory.json").read_text())
    agent_steps = [s for s in atif["steps"] if s["source"] == "agent"]
    assert len(agent_steps) == len(turns)
    assert all(s.get("observation") for s in agent_steps)
    messages = json.loads((trial["dir"] / "agent" / "messages.json").read_text())  # as sent to the model
    assert sum(m["role"] == "assistant" for m in messages) == len(turns)
    if harness == "terminus-2":
        screen = agent_steps[0]["observation"]["results"][0]["content"]
        assert f"echo {word} > hello.txt" in screen
    job = trial["job"]
    show = documented("tmax show jobs/mini/TASK__ID", TASK__ID=trial["dir"].name, mini=job.name)
    shown = subprocess.run([sys.executable, "-m", "tmax.cli.main", *show[1:]], cwd=job.parents[1], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160"}, timeout=60)
    assert shown.returncode == 0 and f"echo {word} > hello.txt" in shown.stdout, shown.stderr
    assert "no valid bash call" not in shown.stdout
    return job


@pytest.mark.parametrize("harness", ["tmax", "mini-swe", "terminus-2"])
def test_harness_solves_and_fails(tmp_path, harness):
    # The passing and the failing run are two jobs of their own, run at the same time: most of
    # a run is waiting (the service and the container starting, the scripted turns, the verifier).
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(solve, tmp_path, harness, word, outcome)
                for word, outcome in (("hello", "pass"), ("goodbye", "fail"))]
        passed, failed = (run.result() for run in runs)
    # Harbor's own models take every trial's agent/trajectory.json as ATIF, and its viewer serves them.
    loaded = harbor_check(passed, failed)
    assert loaded["failures"] == []
    assert (loaded["jobs"], loaded["trials"], loaded["atif"]) == (2, 2, 2)
    (evals,) = loaded["evals"][passed.name].values()
    assert evals["metrics"] == [{"mean": 1.0}] and evals["pass_at_k"] == {"1": 1.0}
    assert all(t > 0 for t in loaded["tokens"][passed.name])
