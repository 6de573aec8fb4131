"""The light install (`pip install -e .`, no extras): commands that need no torch run
without the extras' packages, and a missing matplotlib costs the chart alone, with a
one-line note. Every subcommand's `--help` works there too.

The extras are made unimportable in a subprocess (`sys.modules[name] = None` makes an
import raise ModuleNotFoundError, as on a machine where the package is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the extras (bench, train, vllm, tracking, data) bring; the core never needs them.
EXTRAS = ("matplotlib", "torch", "transformers", "tokenizers", "safetensors", "ray", "vllm", "wandb", "tensorboard",
          "datasets", "pyarrow")
LIGHT = f"import sys\nfor m in {EXTRAS!r}: sys.modules[m] = None\n"


def light_tmax(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tmax ARGS` as after `pip install -e .` without extras."""
    code = LIGHT + "from tmax.cli.main import app\napp(prog_name='tmax')\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def oracle_and_nop(tmp_path_factory) -> list[Path]:
    """An oracle job and a nop job over two generated tasks on the local sandbox, each run
    by `tmax bench run` on the light install."""
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("light")
    write_splits(root / "tasks", 0, 2, seed=5)
    for agent in ("oracle", "nop"):
        proc = light_tmax("bench", "run", str(root / "tasks" / "heldout"), "-a", agent, "-e", "local",
                          "-o", str(root / "jobs"), "--job-name", agent)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [root / "jobs" / "oracle", root / "jobs" / "nop"]


def test_the_extras_are_really_blocked():
    proc = subprocess.run([sys.executable, "-c", LIGHT + "import matplotlib"], capture_output=True, text=True)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_compare_without_matplotlib_skips_only_the_chart(oracle_and_nop):
    a, b = oracle_and_nop
    proc = light_tmax("bench", "compare", str(a), str(b), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    data = json.loads(proc.stdout)
    assert data["chart"] is None and not (a / "compare.png").exists()
    assert [j["pass_at_1"] for j in data["jobs"]] == [1.0, 0.0]
    notes = [line for line in proc.stderr.splitlines() if line.strip()]
    assert notes == ["note: no chart: matplotlib is not installed (pip install 'tmax[bench]')"]


def test_report_without_matplotlib_skips_only_the_charts(oracle_and_nop):
    job = oracle_and_nop[0]
    proc = light_tmax("bench", "report", str(job))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "no chart: matplotlib is not installed" in proc.stderr
    assert "mean reward 100.00%" in proc.stdout
    assert not list(job.glob("*.png"))


def _command_paths() -> list[list[str]]:
    """Every command and subcommand of `tmax`, as the words typed after `tmax`."""
    import typer

    from tmax.cli.main import app

    paths: list[list[str]] = []

    def walk(cmd, words: list[str]) -> None:
        paths.append(words)
        if hasattr(cmd, "list_commands"):  # a group: its subcommands, loaded as typing them would (lazily)
            ctx = typer.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), words + [name])

    walk(typer.main.get_command(app), [])
    return paths


def test_every_subcommand_has_help_on_the_light_install():
    """One process runs `--help` of every command (a process each would take minutes)."""
    paths = _command_paths()
    assert ["bench", "compare"] in paths and ["learn", "nano"] in paths and ["run"] in paths
    code = LIGHT + (
        "import json\nfrom typer.testing import CliRunner\nfrom tmax.cli.main import app\n"
        f"paths = {paths!r}\nout = {{}}\n"
        "for p in paths:\n"
        "    r = CliRunner().invoke(app, p + ['--help'], prog_name='tmax')\n"
        "    out[' '.join(p)] = [r.exit_code, r.output, repr(r.exception) if r.exit_code else None]\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    for words, (rc, output, exc) in json.loads(proc.stdout).items():
        assert rc == 0, f"tmax {words} --help: exit {rc}: {exc}\n{output}"
        assert f"Usage: tmax {words}".strip() in output, f"tmax {words} --help printed no usage:\n{output}"


@pytest.mark.parametrize("args, extra", [
    (["learn", "-o", "{tmp}/run", "nano"], "train"),
    (["serve", "Qwen/Qwen3-8B"], "vllm"),
    (["data", "export", "{tasks}", "-o", "{tmp}/all.hf", "--format", "hf"], "data"),
    (["data", "import", "hf:{tmp}/all.hf", "-o", "{tmp}/again"], "data"),
])
def test_a_command_that_needs_an_extra_names_it_in_one_line(tmp_path, args, extra):
    tasks = REPO / "tests" / "data" / "tasks"
    proc = light_tmax(*(a.format(tmp=tmp_path, tasks=tasks) for a in args))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"not installed; this needs the {extra} extra: pip install 'tmax[{extra}]'" in lines[0]
    assert lines[0].startswith(f"tmax {args[0]}: ")


@pytest.mark.parametrize("placement", [["--nodes", "8"], ["--nodes", "2", "--gpus-per-node", "8"]])
def test_learn_dry_run_plans_a_cluster_job_without_torch(tmp_path, placement):
    """A login node with the light install plans the job: the plan, the run's config and the
    sbatch script, with no torch, transformers or Ray to import."""
    proc = light_tmax("learn", *placement, "--dry-run", "-o", str(tmp_path / "job"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    script = (tmp_path / "job" / "tmax-learn.sbatch").read_text()
    assert f"#SBATCH --nodes={placement[1]}" in script and "--gpus-per-node=8" in script
    assert f"exec tmax learn --config {tmp_path / 'job' / 'learn.toml'}" in script
    assert "plan (json):" in proc.stdout and (tmp_path / "job" / "learn.toml").is_file()


@pytest.mark.parametrize("words", [[], ["sft"], ["nano"], ["sft", "--from-runs", "."]])
def test_learn_that_needs_torch_names_the_extra(tmp_path, words):
    """Training itself on the light install: exit 2 and one line saying what to install,
    before any work (nothing is written)."""
    out = tmp_path / "run"
    proc = light_tmax("learn", "--out", str(out), "--no-progress", *words)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["tmax learn: torch, transformers, safetensors, ray are not installed; this needs the train "
                     "extra: pip install 'tmax[train]'"], proc.stderr
    assert not out.exists()


def test_the_actor_modules_import_without_ray_or_torch():
    """The Ray actors are plain classes, wrapped with `ray.remote` only where they are created."""
    code = LIGHT + ("from tmax.training.cluster import actors, engine_actor, learner_rank, rollout_worker\n"
                    "assert actors.LearnerRank is learner_rank.LearnerRank and not hasattr(actors.LearnerRank, 'remote')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
