"""The wheel holds only `tmax`, and the light install works from it.

The wheel is built from the project's sources (`pip wheel . --no-deps`) and installed into a
fresh venv (`python -m venv`, no system site packages) with the core dependencies only, from
the pip cache or PyPI; it gets no pip of its own (that install costs seconds), this
interpreter's pip installs into it (`pip --python`). The installed distribution's
`top_level.txt` and `RECORD` name one top-level package, `tmax` (plus its dist-info and the
`tmax` script); the commands that need no extra run there, and one that needs an extra ends
with one line naming it (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from documented import documented

REPO = Path(__file__).resolve().parents[2]
HARBOR_JOB = REPO / "tests" / "data" / "harbor-job" / "h"

pytestmark = pytest.mark.slow  # the build and the core dependencies' install: about a minute
# The fresh venv sees nothing of the caller's: no PYTHONPATH (a checkout on it would stand in
# for the installed package).
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _sources(dest: Path) -> Path:
    """What the wheel is built from, copied so that the build leaves nothing in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "tmax", dest / "tmax", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def light(tmp_path_factory) -> dict:
    """{venv, site, dist_info, work}: the wheel installed into a fresh venv without extras."""
    root = tmp_path_factory.mktemp("wheel")
    src = _sources(root / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(root / "dist"), "-q"],
                   cwd=src, check=True, timeout=600, env=ENV)
    wheels = list((root / "dist").glob("tmax-*.whl"))
    assert len(wheels) == 1, wheels
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300, env=ENV)
    subprocess.run([*_pip(venv), "install", "-q", str(wheels[0])],
                   check=True, timeout=900, env=ENV)
    site = Path(_python(venv, "import sysconfig; print(sysconfig.get_paths()['purelib'])", root).stdout.strip())
    dist_info = [p for p in site.glob("tmax-*.dist-info")]
    assert len(dist_info) == 1, dist_info
    work = root / "work"
    work.mkdir()
    return {"venv": venv, "site": site, "dist_info": dist_info[0], "work": work, "src": src}


def _pip(venv: Path) -> list[str]:
    """pip, installing into `venv`."""
    return [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]


def _python(venv: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=ENV, check=True)


def _tmax(light: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed `tmax` script, run in a scratch directory."""
    return subprocess.run([str(light["venv"] / "bin" / "tmax"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=light["work"], stdin=subprocess.DEVNULL, env=ENV)


def test_the_only_top_level_package_is_tmax(light):
    dist_info = light["dist_info"]
    assert (dist_info / "top_level.txt").read_text().split() == ["tmax"]
    paths = [line.rsplit(",", 2)[0] for line in (dist_info / "RECORD").read_text().splitlines() if line]
    script = Path("..", "..", "..", "bin", "tmax").as_posix()
    others = [p for p in paths if not p.startswith(("tmax/", f"{dist_info.name}/")) and p != script]
    assert not others, f"the wheel installs more than tmax: {others}"
    assert "tmax/__main__.py" in paths and "tmax/training/configs/nano.toml" in paths
    assert not [p for p in light["site"].iterdir() if p.name in ("cli", "agents", "sandbox", "tasks", "training", "common")]


def test_version_from_the_module_and_the_script(light):
    module = subprocess.run([str(light["venv"] / "bin" / "python"), "-m", "tmax", "--version"],
                            capture_output=True, text=True, timeout=60, cwd=light["work"], env=ENV)
    script = _tmax(light, "--version")
    assert module.returncode == 0 and script.returncode == 0, module.stderr + script.stderr
    assert module.stdout.strip() == script.stdout.strip() == "tmax 0.1.0"


def test_no_extra_is_installed(light):
    code = "import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) is not None for m in %r}))"
    mods = ("torch", "transformers", "ray", "vllm", "matplotlib", "datasets", "pyarrow")
    proc = _python(light["venv"], code % (mods,), light["work"])
    assert not any(json.loads(proc.stdout).values()), proc.stdout


def test_help_of_every_command(light):
    top = _tmax(light, "--help")
    assert top.returncode == 0 and "Usage: tmax" in top.stdout, top.stderr
    for name in ("run", "show", "serve", "sandbox", "bench", "learn", "data"):
        assert name in top.stdout
        proc = _tmax(light, name, "--help")
        assert proc.returncode == 0, f"tmax {name} --help: {proc.stderr}"
        assert f"Usage: tmax {name}" in proc.stdout


def test_bench_report_and_show_of_a_harbor_job(light, tmp_path):
    job = tmp_path / "h"
    shutil.copytree(HARBOR_JOB, job)
    report = _tmax(light, "bench", "report", str(job))
    assert report.returncode == 0, report.stderr
    assert "mean reward 50.00%" in report.stdout and "echo-hello" in report.stdout
    assert "Traceback" not in report.stderr
    # Harbor's oracle records no trajectory: show says so in one line (exit 2), no traceback
    shown = _tmax(light, "show", str(job / "echo-hello__wmV8gW2"))
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert [line for line in shown.stderr.splitlines() if line.strip()] == [
        f"tmax show: {job / 'echo-hello__wmV8gW2' / 'agent' / 'trajectory.json'} does not exist"]


def test_learn_dry_run_without_torch(light, tmp_path):
    proc = _tmax(light, "learn", "--nodes", "8", "--dry-run", "-o", str(tmp_path / "plan"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plan" / "learn.toml").is_file() and (tmp_path / "plan" / "tmax-learn.sbatch").is_file()


@pytest.mark.parametrize("args, extra", [
    (["learn", "-o", "{tmp}/run", "nano"], "train"),
    (["serve", "Qwen/Qwen3-8B"], "vllm"),
    (["data", "export", "{tasks}", "-o", "{tmp}/all.hf", "--format", "hf"], "data"),
])
def test_a_command_that_needs_an_extra_names_it(light, tmp_path, args, extra):
    tasks = REPO / "tests" / "data" / "tasks"
    proc = _tmax(light, *(a.format(tmp=tmp_path, tasks=tasks) for a in args))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"tmax {args[0]}: ") and f"pip install 'tmax[{extra}]'" in lines[0]


def test_editable_install_is_the_same_light_install(light):
    """The README's `pip install -e .` as typed, the venv's pip (this interpreter's, for the
    venv), into the same venv (last: it replaces the wheel)."""
    subprocess.run([*_pip(light["venv"]), *documented("pip install -e .")[1:]],
                   cwd=light["src"], check=True, timeout=600, env=ENV)
    where = _python(light["venv"], "import tmax; print(tmax.__file__)", light["work"])
    assert Path(where.stdout.strip()) == light["src"] / "tmax" / "__init__.py"
    assert _tmax(light, "--version").stdout.strip() == "tmax 0.1.0"
    proc = _tmax(light, "learn", "-o", str(light["work"] / "run"), "nano")
    assert proc.returncode == 2 and "pip install 'tmax[train]'" in proc.stderr, proc.stderr
