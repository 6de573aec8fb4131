"""The commands a new user types first, run as typed in real processes:

* `tmax run "fix the failing build"` in a project whose build fails, the model (a scripted
  server, found through $TMAX_BASE_URL and asked for its model name) issuing the commands
  that fix it: afterwards the build passes;
* docs/bench.md's offline lines (`tmax bench prepare ../shared/tb2-sample`, an oracle job,
  `tmax bench terminal-bench -a oracle`, report, resume), from a checkout whose sample holds
  one Terminal-Bench 2.0 task (the `terminal-bench@2.0` name resolved from the local dataset
  cache): every one of the paper's 5 attempts passes and no container is left. (The oracle and nop on six sample
  tasks of both base kinds are tests/integration/test_bench_oracle.py's.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from documented import documented
from scripted_server import ScriptedServer
from tmax.agents.prompts import SUBMIT_MARKER

REPO = Path(__file__).resolve().parents[2]
TMAX = [sys.executable, "-m", "tmax.cli.main"]
# The sample next to the checkout, as the other bench tests find it (or where TMAX_TB2_SAMPLE says).
SAMPLE = Path(os.environ.get("TMAX_TB2_SAMPLE") or REPO.parent / "shared" / "tb2-sample")
# A sample task with a small image, a short oracle and the shortest verifier of the light
# subset (each trial's verifier installs its test tools, so every task here costs 5 of them).
TB2_TASKS = ("sqlite-db-truncate",)

MAKEFILE = "app: main.c\n\tgcc -Wall -o app main.c\n"
BROKEN_MAIN = '#include <stdio.h>\nint main(void) {\n    printf("built\\n")\n    return 0;\n}\n'


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No model settings from the caller; private config and data dirs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    return {**env, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_DATA_HOME": str(tmp_path / "data"),
            "NO_COLOR": "1", **extra}


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None, reason="needs make and gcc")
def test_run_fixes_the_failing_build(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "Makefile").write_text(MAKEFILE)
    (proj / "main.c").write_text(BROKEN_MAIN)
    assert subprocess.run(["make", "-C", str(proj)], capture_output=True).returncode != 0  # it fails to start with
    script = [
        {"bash": "make"},
        {"bash": "sed -i 's/printf(\"built\\\\n\")$/printf(\"built\\\\n\");/' main.c"},
        {"bash": f"make && ./app && echo {SUBMIT_MARKER}"},
    ]
    with ScriptedServer(script, model="scripted-fixer") as srv:
        # As typed in the project: the endpoint from the environment, the model asked from it.
        # Approvals on stdin in case the default sandbox here is `local` (confirm mode).
        proc = subprocess.run([*TMAX, *documented('tmax run "fix the failing build"')[1:]], cwd=proj, input="\n" * 5, text=True,
                              capture_output=True, timeout=180, env=clean_env(tmp_path, TMAX_BASE_URL=srv.base_url))
        requests = srv.requests
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(requests) == 3 and requests[0]["model"] == "scripted-fixer"
    assert "fix the failing build" in json.dumps(requests[0]["messages"])
    assert "error" in json.dumps(requests[1]["messages"][-1])  # the model saw the build fail
    build = subprocess.run(["make", "-C", str(proj)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    assert subprocess.run([str(proj / "app")], capture_output=True, text=True).stdout == "built\n"


@pytest.mark.podman
@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_terminal_bench_oracle_offline(tmp_path):
    """docs/bench.md's offline lines as typed, from a checkout whose ../shared/tb2-sample holds
    the sample's TB2_TASKS (the whole sample builds 37 images): prepare, a one-attempt oracle
    job and the TB 2.0 protocol's 5 attempts at the same time, that job's report and resume."""
    if not SAMPLE.is_dir() or shutil.which("podman") is None or subprocess.run(
            ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
        pytest.skip("needs ../shared/tb2-sample, podman and the base image")
    sample = tmp_path / "shared" / "tb2-sample"
    for name in TB2_TASKS:
        shutil.copytree(SAMPLE / name, sample / name)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    (datasets / "terminal-bench@2.0").symlink_to(sample)  # the local dataset cache
    # The verifiers install their test tools (apt, PyPI) in every trial: minutes on a loaded machine.
    # They wait on downloads as much as on the CPU, so the 5 attempts run at once, not 4 then 1.
    env = clean_env(tmp_path, TMAX_DATASETS_DIR=str(datasets), TMAX_BENCH_N_CONCURRENT=str(5 * len(TB2_TASKS)))

    def start(line: list[str], out=subprocess.PIPE) -> subprocess.Popen:
        return subprocess.Popen([*TMAX, *line[1:]], cwd=checkout, stdout=out, stderr=subprocess.STDOUT,
                                text=True, env=env, stdin=subprocess.DEVNULL)

    def tmax(line: list[str], timeout: float = 120) -> str:
        proc = start(line)
        out = proc.communicate(timeout=timeout)[0]
        assert proc.returncode == 0, f"{' '.join(line)}:\n{out[-3000:]}"
        return out

    tmax(documented("tmax bench prepare ../shared/tb2-sample"), timeout=1200)  # the images, built or from the cache
    with open(tmp_path / "oracle-check.log", "w") as log:
        check = start(documented("tmax bench run ../shared/tb2-sample -a oracle -n 4 --job-name oracle-check"), out=log)
        tmax(documented("tmax bench terminal-bench -a oracle"), timeout=2400)
        assert check.wait(timeout=600) == 0, (tmp_path / "oracle-check.log").read_text()[-3000:]
    (job,) = [d for d in (checkout / "jobs").iterdir() if d.name != "oracle-check"]
    results = [json.loads(p.read_text()) for p in job.glob("*/result.json")]
    assert sorted(r["task_name"] for r in results) == sorted(TB2_TASKS * 5)
    assert {r["tmax"]["outcome"] for r in results} == {"pass"}, [r["exception_info"] for r in results]
    checked = checkout / "jobs" / "oracle-check"
    assert [json.loads(p.read_text())["tmax"]["outcome"] for p in checked.glob("*/result.json")] == ["pass"]
    report = tmax(documented("tmax bench report jobs/oracle-check"))
    assert "oracle-check" in report and "mean reward 100.00% over 1 trials" in " ".join(report.split()), report
    before = {p: p.stat().st_mtime for p in checked.glob("*/result.json")}
    tmax(documented("tmax bench resume jobs/oracle-check"))  # every trial has its result: nothing runs again
    assert {p: p.stat().st_mtime for p in checked.glob("*/result.json")} == before
    for name in (job.name, "oracle-check"):
        left = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=io.tmax.job={name}"],
                              capture_output=True, text=True).stdout.split()
        assert left == []
