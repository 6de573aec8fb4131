"""The fork chaos run (`benchmarks/chaos_fork.py`), one round of each fault, as typed: forked
podman overlay episodes whose host container is killed while their branches run, a child
episode killed while it starts, and a process killed while it forks; no branch reports success
after the kill, the parent of a failed fork keeps its state, every room and layer comes back,
and nothing of the run is left (containers, state directories, cgroups, processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.podman
def test_one_round_of_each_fork_fault_loses_and_leaks_nothing(base_image):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos_fork.py"), "--json", "--rounds", "1",
                        "--image", base_image],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert all(out["ok"].values()), out
    killed = out["container"][0]
    assert killed["detected"] + killed["completed_before_kill"] == killed["branches"] == 3, killed
    assert killed["cgroups_seen_while_live"], killed  # the leak check sees a live container's groups
    assert out["fork_halfway"][0]["injected"] and out["fork_halfway"][0]["fork_raised"], out["fork_halfway"]
