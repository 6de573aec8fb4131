"""Placement plans, the plan text / sbatch script and the resource check (no Ray here;
the live-cluster versions are in test_multinode.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tmax.training.cluster import launch as cluster
from tmax.training.cluster.placement import ROLE_INFER, ROLE_TRAIN, PlanError, make_plan
from tmax.training.cluster.reservation import NodeInfo, check_resources, nodes_from_ray
from tmax.training.cluster.slurm import sbatch_script


def test_eight_nodes_is_the_paper_layout():
    p = make_plan(8, gpus_per_node=8)
    assert (p.train_nodes, p.infer_nodes) == (2, 6)
    assert p.learner_ranks == 16 and p.learners_per_node == 8
    assert p.engines == 48 and p.tp == 1 and p.engines_per_node == 8
    assert p.node_roles() == [[ROLE_TRAIN]] * 2 + [[ROLE_INFER]] * 6


def test_plan_text_and_sbatch_script_for_eight_nodes():
    plan = make_plan(8, gpus_per_node=8)
    text = plan.describe()
    assert "16 rank(s) on 2 train node(s)" in text
    assert "48 x TP 1 on 6 inference node(s)" in text
    assert "node 1      train        learner ranks 8-15" in text
    assert "node 7      inference    engines 40-47" in text
    assert plan.to_dict()["learner_ranks"] == 16 and plan.to_dict()["engines"] == 48
    script = sbatch_script(plan, ["--config", "my run.toml"])
    assert script.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=8", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "export RAY_AUTH_MODE=\"${RAY_AUTH_MODE:-disabled}\" RAY_USAGE_STATS_ENABLED=0"):
        assert line in script.splitlines()
    # The driver command quotes its arguments.
    assert "exec tmax learn --config 'my run.toml'" in script


def test_sbatch_script_is_valid_bash(tmp_path):
    f = tmp_path / "job.sbatch"
    f.write_text(sbatch_script(make_plan(4, gpus_per_node=8, tp=2), ["--steps", "3"], cpus_per_node=96))
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # Directives must precede the first command for sbatch to read them.
    lines = f.read_text().splitlines()
    first_cmd = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
    assert all(i < first_cmd for i, l in enumerate(lines) if l.startswith("#SBATCH"))
    assert "#SBATCH --cpus-per-task=96" in lines


def test_default_splits_and_tp():
    assert (make_plan(2).train_nodes, make_plan(2).infer_nodes) == (1, 1)
    assert (make_plan(4).train_nodes, make_plan(4).infer_nodes) == (2, 2)  # the 2B / 4B scripts
    assert make_plan(16).train_nodes == 4
    p = make_plan(3, gpus_per_node=8, tp=4)
    assert p.engines_per_node == 2 and p.engines == 4
    assert p.engine_bundle(False) == {"CPU": 8.0, "GPU": 8.0}
    one = make_plan(1, gpus_per_node=8)
    assert one.colocated and one.learner_ranks == 4 and one.engines == 4
    cpu = make_plan(2, gpus_per_node=0, learners_per_node=2, engines_per_node=2)
    assert cpu.learner_bundle(True) == {"CPU": 2.0, ROLE_TRAIN: 1.0}


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(nodes=0), "--nodes must be >= 1"),
        (dict(nodes=8, train_nodes=8), "between 1 and 7"),
        (dict(nodes=2, gpus_per_node=8, tp=16), "does not fit"),
        (dict(nodes=2, gpus_per_node=0, tp=2), "needs GPUs"),
        (dict(nodes=1, gpus_per_node=1), "cannot hold a learner and an engine"),
        (dict(nodes=2, gpus_per_node=-1), "--gpus-per-node"),
    ],
)
def test_bad_flags_are_specific(kwargs, msg):
    with pytest.raises(PlanError, match=msg):
        make_plan(**kwargs)


def _node(i, gpu, cpu, **extra):
    return NodeInfo(f"{i:02d}" * 8, f"10.0.0.{i}", {"GPU": gpu, "CPU": cpu, **extra})


def test_resource_check_fits_and_names_what_is_missing():
    plan = make_plan(8, gpus_per_node=8)
    full = [_node(i, 8, 128) for i in range(8)]
    assert check_resources(plan, full) == []
    # One node gone and one with only 4 GPUs.
    short = [_node(i, 8, 128) for i in range(6)] + [_node(6, 4, 128)]
    problems = check_resources(plan, short)
    text = "\n".join(problems)
    assert "nodes: the plan needs 8 node(s), the cluster has 7 alive" in text
    assert "engines: need 6 node(s) with 32 CPU, 8 GPU each, found 4" in text
    assert "10.0.0.6 (06060606) lacks 4 GPU" in text
    # CPUs: learner nodes need 8 x 4 CPU.
    problems = check_resources(plan, [_node(i, 8, 16) for i in range(8)])
    assert any(p.startswith("learners: need 2 node(s) with 32 CPU, 8 GPU each, found 0") for p in problems)
    assert any("lacks 16 CPU" in p for p in problems)


def test_resource_check_sandbox_cpus_and_roles():
    plan = make_plan(2, gpus_per_node=0, sandbox_workers=8)
    nodes = [_node(0, 0, 2, **{ROLE_TRAIN: 1}), _node(1, 0, 2, **{ROLE_INFER: 1})]
    problems = check_resources(plan, nodes)
    assert problems == ["sandbox workers: need 8 CPU for 8 worker(s) after learners and engines, 2 CPU left"]
    # Role resources present: a node without the train role cannot host learners.
    nodes = [_node(0, 0, 8, **{ROLE_INFER: 1}), _node(1, 0, 8, **{ROLE_INFER: 1})]
    problems = check_resources(make_plan(2, gpus_per_node=0), nodes)
    assert any("learners: need 1 node(s)" in p and f"lacks 1 {ROLE_TRAIN}" in p for p in problems)


def test_nodes_from_ray_skips_dead_nodes():
    raw = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "1.2.3.4", "Resources": {"CPU": 4.0}},
        {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "1.2.3.5", "Resources": {"CPU": 4.0}},
    ]
    assert [n.address for n in nodes_from_ray(raw)] == ["1.2.3.4"]


def test_cluster_mode_and_env(monkeypatch):
    assert cluster.resolve_mode(None, {}) == "local"
    assert cluster.resolve_mode(None, {"SLURM_JOB_NODELIST": "gpu[01-08]"}) == "slurm"
    assert cluster.resolve_mode(None, {"RAY_ADDRESS": "h:6379", "SLURM_JOB_NODELIST": "x"}) == "address"
    assert cluster.resolve_mode("h:6379", {}) == "address"
    env = cluster.ray_env({"RAY_AUTH_MODE": "token"})
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert cluster.ray_env({})["RAY_AUTH_MODE"] == "disabled"
    # What every tmax process applies before Ray (launch.connect) keeps the user's mode.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    cluster.apply_ray_env()
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_slurm_commands_carry_roles():
    plan = make_plan(3, gpus_per_node=8)
    head = cluster.head_start_cmd(plan, 6379, "10.0.0.1")
    assert "--head" in head and f'--resources={{"{ROLE_TRAIN}": 1.0}}' in head
    workers = cluster.worker_start_cmds(plan, ["n1", "n2", "n3"], "10.0.0.1:6379")
    assert [w[4] for w in workers] == ["--nodelist=n2", "--nodelist=n3"]
    assert all(w[0] == "srun" and "--overlap" in w and "--block" in w for w in workers)
    assert f'--resources={{"{ROLE_INFER}": 1.0}}' in workers[0]


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="a real Slurm install is present")
def test_slurm_without_scontrol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    with pytest.raises(cluster.ClusterError, match="`scontrol` is not on PATH"):
        cluster.slurm_hostnames()


def test_describe_names_the_weight_transport_in_use():
    """The printout says how the weights travel: NCCL by default on GPUs, the object
    store on CPU, and whatever the config chose."""
    gpu, cpu = make_plan(2, gpus_per_node=8), make_plan(2, gpus_per_node=0)
    assert "by NCCL broadcast GPU to GPU" in gpu.describe()
    assert "through the Ray object store" in cpu.describe()
    assert "by gloo broadcast" in cpu.describe("gloo") and "by gloo broadcast" in gpu.describe("gloo")
    assert "impossible here" in cpu.describe("nccl")


def test_sandbox_nodes_join_the_plan_its_text_and_the_sbatch_script(tmp_path):
    """`--sandbox-nodes K`: K CPU nodes after the GPU nodes, one rollout worker each, their own
    component of a heterogeneous Slurm job."""
    from tmax.training.cluster.sandbox_nodes import ROLE_SANDBOX

    plan = make_plan(8, gpus_per_node=8, sandbox_nodes=2, sandbox_workers=16)
    assert plan.node_roles() == [[ROLE_TRAIN]] * 2 + [[ROLE_INFER]] * 6 + [[ROLE_SANDBOX]] * 2
    assert plan.sandbox_workers == 2  # one worker, and one pool, per sandbox node
    text = plan.describe()
    assert text.splitlines()[0] == "placement plan: 8 node(s), 8 GPU/node + 2 sandbox node(s), CPU only"
    assert "node 8      sandbox      rollout worker 0" in text and "node 9      sandbox      rollout worker 1" in text
    assert "no container runs beside a learner or an engine" in text
    assert make_plan(1, gpus_per_node=0, sandbox_nodes=1).node_roles() == [[ROLE_TRAIN, ROLE_INFER], [ROLE_SANDBOX]]
    lines = sbatch_script(plan, ["--config", "run.toml"]).splitlines()
    het = lines.index("#SBATCH hetjob")
    assert "#SBATCH --nodes=8" in lines[:het] and "#SBATCH --gpus-per-node=8" in lines[:het]
    assert "#SBATCH --nodes=2" in lines[het:] and not any("gpus" in x for x in lines[het:] if x.startswith("#SBATCH"))
    f = tmp_path / "job.sbatch"
    f.write_text("\n".join(lines))
    assert subprocess.run(["bash", "-n", str(f)]).returncode == 0
    workers = cluster.worker_start_cmds(plan, [f"n{i}" for i in range(10)], "10.0.0.1:6379",
                                        components=[0] * 8 + [1] * 2)
    assert f'--resources={{"{ROLE_SANDBOX}": 1.0}}' in workers[-1] and "--het-group=1" in workers[-1]
    assert "--het-group=0" in workers[0]


def test_resource_check_asks_for_the_sandbox_nodes():
    from tmax.training.cluster.sandbox_nodes import ROLE_SANDBOX

    plan = make_plan(1, gpus_per_node=0, sandbox_nodes=1, cpus_per_sandbox_worker=1.0)
    gpu_node = NodeInfo("a" * 16, "10.0.0.1", {"CPU": 4.0, ROLE_TRAIN: 1.0, ROLE_INFER: 1.0})
    assert check_resources(plan, [gpu_node, NodeInfo("b" * 16, "10.0.0.2", {"CPU": 8.0, ROLE_SANDBOX: 1.0})]) == []
    problems = check_resources(plan, [gpu_node, NodeInfo("c" * 16, "10.0.0.3", {"CPU": 8.0})])
    assert any(p.startswith("sandbox nodes: need 1 node(s)") and "no node carries the tmax_sandbox" in p
               for p in problems), problems
