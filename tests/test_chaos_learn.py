"""The short chaos run (`benchmarks/chaos_learn.py --short`): a `tmax learn` run on podman
survives a killed task container, a killed vLLM server and a killed rollout worker, then a
SIGKILLed driver is resumed and finishes every step, with no infrastructure reward and no
episode twice in what was trained, and nothing of the run left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.podman
def test_short_chaos_run_recovers_every_fault(tmp_path, base_image):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos_learn.py"), "--json", "--short",
                        "--out", str(tmp_path / "chaos")], capture_output=True, text=True, timeout=3000)
    assert r.stdout.strip(), r.stderr[-3000:]
    out = json.loads(r.stdout)
    log = (tmp_path / "chaos" / "drivers.log").read_text()[-4000:]
    assert set(out["faults"]) == {"container", "engine", "worker", "driver"}, out
    for kind, f in out["faults"].items():
        assert f["injected"] == f["detected"] == f["recovered"] == 1, (kind, out["schedule"], log)
    assert out["faults"]["worker"]["episodes_requeued"] >= 1
    assert out["steps_completed"] == out["steps_target"], (out, log)
    assert out["infra_rewards_in_loss"] == 0 and out["duplicate_groups_in_loss"] == 0, out
    assert out["leftover_containers"] == 0 and out["leftover_processes"] == 0, out
    assert r.returncode == 0
