"""A real 2-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): the resource
check against it, placement groups pinning learners / engines to the planned nodes, two
gloo learner ranks training a tiny Qwen3 with DPPO and pushing weights to two engines
(two syncs over one gloo weight group), and an actor killed mid-work that is restarted
with its item re-queued."""

from __future__ import annotations

import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")
import torch  # noqa: E402

from training.cluster import launch as cluster  # noqa: E402
from training.learner import parallel as D  # noqa: E402
from training.net import free_port, node_ip  # noqa: E402
from training.algo.dppo import LossConfig, policy_loss  # noqa: E402
from training.cluster.placement import ROLE_INFER, ROLE_TRAIN, check_live_cluster, make_plan, reserve  # noqa: E402
from training.weights.group import WeightGroup, WeightSender, receive  # noqa: E402
from training.weights.protocol import load_into  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
MB = 1024 * 1024


def tiny_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


def token_logprobs(model, ids):
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


class LearnerActor:
    def __init__(self):
        torch.set_num_threads(1)

    def node(self):
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self):
        return node_ip(), free_port()

    def setup(self, rank, world, host, port):
        self.ctx = D.init_learner_group(rank, world, host, port, backend="gloo", timeout_s=120)
        self.model = D.shard_model(tiny_model(seed=0), self.ctx)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        return self.ctx.rank

    def logprobs(self, ids):
        with torch.no_grad():
            return token_logprobs(self.model, ids)

    def train_step(self, ids, mask, adv):
        """One DPPO step on this rank's shard of the batch, global token denominator."""
        n = D.data_parallel(self.ctx).all_reduce(torch.tensor(float(mask.sum()), dtype=torch.float64))
        new = token_logprobs(self.model, ids)
        old = new.detach() - 0.05  # sampler log-probs a little below: ratios above 1
        loss, stats = policy_loss(new, old, adv[:, None].expand_as(new), mask, LossConfig(), denominator=float(n))
        self.opt.zero_grad()
        (loss * self.ctx.grad_scale).backward()
        norm = D.clip_grad_norm(self.model, 1.0)
        self.opt.step()
        return {"tokens": float(n), "grad_norm": norm, "kept": stats.kept}

    def init_weight_group(self, host, port, world):
        self.group = WeightGroup(host, port, 0, world, backend="gloo", timeout_s=120)

    def prepare_weights(self, version):
        full = D.full_weights(self.model, self.ctx)  # collective over learner ranks
        if not self.ctx.is_main:
            return None
        self.sender = WeightSender(self.group, bucket_mb=0.1)
        return self.sender.prepare(full, version)

    def send(self):
        self.sender.send()


class EngineActor:
    def __init__(self, seed):
        torch.set_num_threads(1)
        self.model = tiny_model(seed=seed).eval()
        self.version = -1
        self.group = None

    def node(self):
        return ray.get_runtime_context().get_node_id()

    def init_weight_group(self, host, port, rank, world):
        self.group = WeightGroup(host, port, rank, world, backend="gloo", timeout_s=120)

    def receive(self, update):
        load_into(self.model, receive(self.group, update))
        self.version = update.version
        return self.version

    def logprobs(self, ids):
        with torch.no_grad():
            return token_logprobs(self.model, ids), self.version


class Worker:
    """A sandbox-worker stand-in whose process is killed (SIGKILL) once, mid-item."""

    def run(self, item, marker):
        if item == 3 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), 9)
        time.sleep(0.1)
        return item * item, os.getpid()


@pytest.fixture(scope="module")
def two_nodes():
    cluster.apply_ray_env()
    from ray.cluster_utils import Cluster

    # Actor classes of this test module travel by value: workers need not import tests/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
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


def test_actors_placed_per_plan_train_and_sync(two_nodes):
    plan = cpu_plan()
    placement = reserve(plan, timeout_s=120)
    try:
        train_node, infer_node = role_node(ROLE_TRAIN), role_node(ROLE_INFER)
        assert placement.learner_nodes == [train_node] and placement.engine_nodes == [infer_node]
        L = ray.remote(LearnerActor)
        E = ray.remote(EngineActor)
        learners = [L.options(**placement.learner_options(r)).remote() for r in range(plan.learner_ranks)]
        engines = [E.options(**placement.engine_options(i)).remote(100 + i) for i in range(plan.engines)]
        assert ray.get([a.node.remote() for a in learners]) == [train_node] * 2
        assert ray.get([e.node.remote() for e in engines]) == [infer_node] * 2

        host, port = ray.get(learners[0].rendezvous.remote())
        ray.get([a.setup.remote(r, 2, host, port) for r, a in enumerate(learners)], timeout=180)

        # Batch: 4 sequences split 1 / 3 over the ranks (unequal token counts).
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 300, (4, 12), generator=g)
        mask = torch.zeros(4, 11)
        mask[:, 5:] = 1
        mask[0, 8:] = 0
        adv = torch.tensor([1.0, -0.5, 0.5, -1.0])
        shards = [slice(0, 1), slice(1, 4)]
        out = ray.get(
            [a.train_step.remote(ids[s], mask[s], adv[s]) for a, s in zip(learners, shards)], timeout=180
        )
        assert out[0]["tokens"] == out[1]["tokens"] == float(mask.sum())
        assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"])

        # Learner log-probs on both ranks (FSDP forward is a collective).
        ref = ray.get([a.logprobs.remote(ids) for a in learners], timeout=60)[0]

        # Sync 1: gloo weight group {learner 0, engine 0, engine 1}.
        whost, wport = ray.get(learners[0].rendezvous.remote())
        ray.get(
            [learners[0].init_weight_group.remote(whost, wport, 3)]
            + [e.init_weight_group.remote(whost, wport, i + 1, 3) for i, e in enumerate(engines)],
            timeout=120,
        )
        update = ray.get([a.prepare_weights.remote(1) for a in learners], timeout=60)[0]
        assert update.transport == "gloo" and len(update.buckets) >= 2
        recv = [e.receive.remote(update) for e in engines]
        ray.get(learners[0].send.remote(), timeout=60)
        assert ray.get(recv, timeout=60) == [1, 1]
        for e in engines:
            lp, version = ray.get(e.logprobs.remote(ids))
            assert version == 1
            torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)

        # A second step, then sync 2 over the same group.
        ray.get([a.train_step.remote(ids[s], mask[s], adv[s]) for a, s in zip(learners, shards)], timeout=180)
        ref2 = ray.get([a.logprobs.remote(ids) for a in learners], timeout=60)[0]
        assert (ref2 - ref).abs().max() > 1e-3  # the step changed the policy
        update = ray.get([a.prepare_weights.remote(2) for a in learners], timeout=60)[0]
        recv = [e.receive.remote(update) for e in engines]
        ray.get(learners[0].send.remote(), timeout=60)
        assert ray.get(recv, timeout=60) == [2, 2]
        for e in engines:
            lp, version = ray.get(e.logprobs.remote(ids))
            assert version == 2
            torch.testing.assert_close(lp, ref2, rtol=0, atol=1e-5)
        for a in learners + engines:
            ray.kill(a)
    finally:
        placement.remove()


def test_killed_actor_restarts_and_work_is_requeued(two_nodes, tmp_path):
    W = ray.remote(Worker).options(max_restarts=1, max_task_retries=0, num_cpus=0.25)
    workers = [W.remote() for _ in range(2)]
    marker = str(tmp_path / "killed")
    items = list(range(6))
    results, stats = cluster.requeue_map(workers, items, lambda a, i: a.run.remote(i, marker), restart_wait_s=120)
    assert [r[0] for r in results] == [i * i for i in items]
    assert stats.requeued == 1 and stats.completed == 6
    killed_pid = int(open(marker).read())
    assert results[3][1] != killed_pid  # item 3 finished on a live (restarted or other) process
    # The killed actor came back: both actors answer again.
    assert len(ray.get([w.run.remote(0, marker) for w in workers], timeout=120)) == 2
    for w in workers:
        ray.kill(w)


def test_requeue_gives_up_after_max_attempts(two_nodes, tmp_path):
    @ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0.25)
    class AlwaysDies:
        def run(self, item):
            os.kill(os.getpid(), 9)

    a = AlwaysDies.remote()
    with pytest.raises(cluster.ClusterError, match="lost its actor 2 times"):
        cluster.requeue_map([a], [0], lambda act, i: act.run.remote(i), max_attempts=2, restart_wait_s=120)
    ray.kill(a)
