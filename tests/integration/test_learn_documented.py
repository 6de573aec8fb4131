"""The `tmax learn` lines of README.md and docs/learn.md, run exactly as a page writes them
(`documented`), with the options after the subcommand where a person types them.

Each run is the nano recipe (build -> SFT -> held-out eval -> RL -> held-out eval) made
small by `TMAX_LEARN_*` variables, the way a user shrinks it too (test_learn_cli.SMALL_NANO);
the command line itself is the page's. What is checked is that each option took effect: the
run directory, the seed, the steps, the sandbox, the preset. Learning is the recipe test's
(test_nano_recipe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from documented import documented
from test_learn_cli import SMALL_NANO, learn_env

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]


def run_line(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    assert argv[0] == "tmax"
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", *argv[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1700)


def small_env(shared_ray: str, **extra: str) -> dict[str, str]:
    """The nano recipe sized for a test, on the session's Ray cluster."""
    return learn_env(**SMALL_NANO, TMAX_LEARN_EVAL__ATTEMPTS="1", TMAX_LEARN_GUARD__ENABLED="false",
                     **extra) | {"RAY_ADDRESS": shared_ray}


@pytest.mark.podman
@pytest.mark.timeout(1800)
def test_podman_recipe_with_options_after_the_subcommand(tmp_path, base_image, shared_ray):
    out = tmp_path / "np"
    argv = documented("tmax learn nano -c nano-podman -o DIR --seed 1 --steps 2", DIR=str(out))
    r = run_line(argv, tmp_path, small_env(shared_ray))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "held-out pass rate: SFT" in r.stderr
    res = json.loads((out / "recipe.json").read_text())
    assert (res["seed"], res["rl"]["steps"]) == (1, 2)
    ran = tomllib.loads((out / "rl" / "config.toml").read_text())
    assert (ran["name"], ran["algo"]["seed"], ran["algo"]["steps"]) == ("nano-podman", 1, 2)
    assert ran["rollout"]["sandbox"] == ran["eval"]["sandbox"] == "podman"
    # The held-out trials ran in podman containers (the job's environment).
    job = json.loads(next((out / "eval").glob("*/config.json")).read_text())
    assert job["tmax_job"]["environment"] == "podman"
    assert not (tmp_path / "runs").exists()  # nothing in the preset's run.out_dir


@pytest.mark.timeout(1800)
def test_bare_nano_recipe_into_the_presets_directory(tmp_path, shared_ray):
    r = run_line(documented("tmax learn nano"), tmp_path, small_env(shared_ray, TMAX_LEARN_ALGO__STEPS="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    out = tmp_path / "runs" / "nano"  # the nano preset's run.out_dir, under the current directory
    res = json.loads((out / "recipe.json").read_text())
    assert res["rl"]["steps"] == 1 and res["sft_eval"]["trials"] == 1
    assert "held-out pass rate: SFT" in r.stderr
