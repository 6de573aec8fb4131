"""A real 2-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): the resource
check against it, and the production learner group (`training.cluster.actors.LearnerGroup`)
placed per a plan: two gloo ranks on the train node train the nano model with DPPO, and
their step is the step one rank takes on the whole batch (same loss-token count, same
gradient norm, same weights).

The full layout (learner ranks, vLLM engines, rollout workers, the `Trainer`) on two nodes
runs through the CLI in `tests/integration/test_learn_multinode.py`."""

from __future__ import annotations

import json
import random

import pytest

ray = pytest.importorskip("ray")

from tmax.training.cluster import launch as cluster  # noqa: E402
from tmax.training.cluster.placement import ROLE_INFER, ROLE_TRAIN, check_live_cluster, make_plan, reserve  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
MB = 1024 * 1024


@pytest.fixture(scope="module")
def two_nodes():
    cluster.apply_ray_env()
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2, "resources": {ROLE_TRAIN: 1}, "include_dashboard": False,
            "object_store_memory": 100 * MB,
        },
    )
    c.add_node(num_cpus=2, resources={ROLE_INFER: 1}, object_store_memory=100 * MB)
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def cpu_plan(**kw):
    base = dict(gpus_per_node=0, learners_per_node=2, engines_per_node=2, cpus_per_learner=0.5,
                cpus_per_engine=0.5, sandbox_workers=2, cpus_per_sandbox_worker=0.25)
    base.update(kw)
    return make_plan(2, **base)


def role_node(role):
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and role in n["Resources"])


def test_resource_check_against_live_cluster(two_nodes):
    assert check_live_cluster(cpu_plan()) == []
    problems = check_live_cluster(make_plan(3, gpus_per_node=0, learners_per_node=1, engines_per_node=1))
    assert "nodes: the plan needs 3 node(s), the cluster has 2 alive" in problems
    assert any(p.startswith("engines: need 2 node(s) with 1 CPU, 1 tmax_infer each, found 1") for p in problems)
    gpu = check_live_cluster(make_plan(2, gpus_per_node=8))
    assert any(p.startswith("learners: need 1 node(s)") and "lacks" in p and "8 GPU" in p for p in gpu)
    cpus = check_live_cluster(cpu_plan(cpus_per_learner=2.0))
    assert any("learners:" in p and "lacks 2 CPU" in p for p in cpus)


def _samples(vocab: int, n: int = 6, seed: int = 0) -> list:
    """Episodes of unequal lengths: prompt, then sampled tokens with sampler logprobs a
    little below the policy's (ratios near 1), some masked out as observations."""
    from tmax.agents.policy import TokenTrace
    from tmax.training.learner.packing import TrainSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 10))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(6, 20))]
        mask = [0 if 3 <= j < 5 else 1 for j in range(len(ids))]
        logprobs = [-rng.uniform(6.0, 9.0) * m for m in mask]
        trace = TokenTrace(prompt, ids, logprobs, mask)
        out.append(TrainSample(trace, advantage=(1.0 if i % 2 else -0.5) * (1 + i / 10)))
    return out


def test_placed_learner_group_steps_like_one_rank(two_nodes, tmp_path):
    from tmax.training.cluster.actors import LearnerGroup
    from tmax.training.config import preset
    from tmax.training.trainer import learner_config
    from tmax.training.nano.model import build_nano_model

    model = tmp_path / "nano"
    build_nano_model(model, seed=0)
    cfg = preset("nano")
    cfg.run.learner_strategy = "fsdp"
    lcfg = learner_config(cfg)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    samples = _samples(vocab)
    plan = cpu_plan()
    placement = reserve(plan, timeout_s=120)
    groups = []
    try:
        two = LearnerGroup.start([placement.learner_options(r) for r in range(2)], str(model), lcfg, None, 1)
        one = LearnerGroup.start([{"num_cpus": 0.5}], str(model), lcfg, None, 1)
        groups = [two, one]
        ray.get(two.setups + one.setups, timeout=300)
        train_node = role_node(ROLE_TRAIN)
        assert ray.get([a.node_id.remote() for a in two.ranks]) == [train_node] * 2

        before = ray.get(one.named_weights())
        m2, m1 = ray.get([two.train_step(samples), one.train_step(samples)], timeout=300)
        assert m2["learner/tokens"] == m1["learner/tokens"] > 0  # reduced over the ranks
        assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-4)
        w2, w1 = ray.get([two.named_weights(), one.named_weights()], timeout=300)
        assert w2.keys() == w1.keys() and max((w1[k] - before[k]).abs().max().item() for k in w1) > 1e-4
        diff = max((w2[k] - w1[k]).abs().max().item() for k in w1)
        assert diff < 0.05 * lcfg.lr, diff  # one Adam step moves a weight by about lr

        # Every rank joins the save (a gather); rank 0 writes a loadable checkpoint.
        path = ray.get(two.save(str(tmp_path / "ckpt"), 1, {"prompt_position": 3}), timeout=300)
        assert (tmp_path / "ckpt" / "config.json").is_file() and path

        # A rank dies: what the group hands back is the survivor's failed collective (gloo:
        # "Connection closed by peer"); the death behind it is found (the loop then stops
        # the step with the resume hint instead of a bare traceback).
        from tmax.training.liveness import group_member_died

        ray.kill(two.ranks[1])
        with pytest.raises(ray.exceptions.RayError) as err:
            ray.get(two.train_step(samples), timeout=300)
        died = group_member_died(err.value, two.ranks)
        assert isinstance(died, ray.exceptions.RayActorError), err.value
        assert died.actor_id == two.ranks[1]._actor_id.hex()
        assert group_member_died(err.value, one.ranks) is None  # every member of that group is alive
        assert group_member_died(ValueError("not Ray's"), two.ranks) is None
    finally:
        for g in groups:
            g.kill()
        placement.remove()
