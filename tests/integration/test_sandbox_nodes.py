"""Sandbox nodes on a real 2-node Ray cluster on one machine (`ray.cluster_utils.Cluster`):
node A carries the learner and engine roles, node B `tmax_sandbox`. The plan's check and its
placement groups put the learner and engine bundles on A and the rollout worker on B, whose
pool is sized from B's CPUs; the production `RolloutWorker` runs real podman episodes there,
and every container the run made, and every episode command (each ran in one of them),
belongs to the worker on B: the containers carry B's node id and the pid of a process under
B's raylet, and the podman service that made them is that worker's child."""

from __future__ import annotations

import json
import subprocess

import psutil
import pytest

ray = pytest.importorskip("ray")

from tmax.training.cluster import launch as cluster  # noqa: E402
from tmax.training.cluster.placement import ROLE_INFER, ROLE_TRAIN, make_plan  # noqa: E402
from tmax.training.cluster.reservation import check_live_cluster, reserve  # noqa: E402
from tmax.training.cluster.sandbox_nodes import NODE_LABEL, ROLE_SANDBOX  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.podman, pytest.mark.timeout(900)]
MB = 1024 * 1024


@pytest.fixture(scope="module")
def two_nodes():
    cluster.apply_ray_env()
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {ROLE_TRAIN: 1, ROLE_INFER: 1}, "include_dashboard": False,
        "object_store_memory": 100 * MB})
    sandbox = c.add_node(num_cpus=3, resources={ROLE_SANDBOX: 1}, object_store_memory=100 * MB)
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c, c.head_node, sandbox
    finally:
        ray.shutdown()
        c.shutdown()


def _plan():
    return make_plan(1, gpus_per_node=0, cpus_per_learner=0.5, cpus_per_engine=0.5, sandbox_nodes=1,
                     cpus_per_sandbox_worker=0.5)


def _raylet_pid(node) -> int:
    return node.all_processes["raylet"][0].process.pid


def _under(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def test_learners_and_engines_stay_off_the_sandbox_node(two_nodes):
    _, head, sandbox = two_nodes
    plan = _plan()
    assert check_live_cluster(plan) == []
    assert any("sandbox nodes: need 2" in p for p in check_live_cluster(make_plan(1, gpus_per_node=0, sandbox_nodes=2)))
    placement = reserve(plan, timeout_s=120)
    try:
        assert placement.learner_nodes == placement.engine_nodes == [head.node_id]
        assert placement.sandboxes.nodes == [sandbox.node_id]
        assert placement.sandboxes.slots(0) == 3  # the pool is sized from the node's CPUs
    finally:
        placement.remove()


@pytest.fixture(scope="module")
def nano(tmp_path_factory, base_image):
    from tmax.training.config import preset
    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits
    from tmax.training.rollout import EpisodeSettings, prepare_tasks, run_labels

    root = tmp_path_factory.mktemp("sandbox-nodes")
    build_tokenizer(0).save_pretrained(root / "tok")
    [task] = write_splits(root / "tasks", 1, 0, seed=0)["train"]
    labels = run_labels(root / "run")
    settings = EpisodeSettings.of(preset("nano-podman").rollout.model_copy(update={
        "observation_max_chars": 2000, "max_tokens": 300, "response_budget": 1500, "context_budget": 4096}),
        labels)
    images = prepare_tasks(settings.env, [str(task)], log=lambda m: None).images
    return root, str(task), settings, images, labels


def _sampler(tokenizer_dir: str, task: str):
    """The task's oracle, then its container's cgroup, then the submit: the same script for
    every episode, whatever order the worker's threads ask in (defined here: Ray pickles it whole)."""
    from transformers import AutoTokenizer

    from tmax.agents.policy import SampledTokens
    from tmax.training.demos import scripted_turns
    from tmax.training.nano.tasks import oracle_steps

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    steps = oracle_steps(task)
    turns = scripted_turns(tok, steps[:-1] + [("THOUGHT: where am I.", "grep -o 'libpod-[0-9a-f]*' /proc/self/cgroup | head -1")]
                           + steps[-1:])

    class Script:
        def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None):
            done = sum(1 for t in turns if any(prompt_ids[i:i + len(t)] == t for i in range(len(prompt_ids))))
            return SampledTokens(turns[done], [0.0] * len(turns[done]), "stop", 0)

    return Script()


def test_every_container_and_command_of_the_run_is_the_sandbox_nodes(two_nodes, nano):
    from tmax.training.cluster.rollout_worker import RolloutWorker
    from tmax.training.rollout import EpisodeRequest

    _, head, sandbox = two_nodes
    root, task, settings, images, labels = nano
    placement = reserve(_plan(), timeout_s=120)
    worker = None
    try:
        slots = placement.sandboxes.slots(0)
        worker = ray.remote(RolloutWorker).options(**placement.sandbox_options(0, max_concurrency=slots + 2)).remote(
            str(root / "tok"), settings, _sampler(str(root / "tok"), task), images, slots)
        assert ray.get(worker.node_id.remote(), timeout=300) == sandbox.node_id
        results = ray.get([worker.generate.remote(EpisodeRequest(task, 0, i, i), 0) for i in range(4)], timeout=600)
        rollouts = [r.rollout for r in results]
        [(key, value)] = labels.items()
        listed = json.loads(subprocess.run(["podman", "ps", "-a", "--format", "json", "--filter",
                                            f"label={key}={value}"], capture_output=True, text=True).stdout)
        containers = {c["Id"]: c["Labels"] for c in listed}
        assert containers  # the hosts are still up, idle, until the worker's pool closes
        raylet = _raylet_pid(sandbox)
        for cid, lab in containers.items():
            assert lab[NODE_LABEL] == sandbox.node_id, f"container {cid[:12]} was started for another node"
            assert _under(int(lab["io.tmax.pid"]), raylet), f"container {cid[:12]}'s owner is not under B's raylet"
        service = [p for p in psutil.Process(int(lab["io.tmax.pid"])).children()
                   if "system service" in " ".join(p.cmdline())]
        assert service, "the podman service that makes the containers is not the worker's child"
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(root / "tok")
        for r in rollouts:
            assert r.reward == 1.0 and r.steps >= 3 and r.sandbox_mode == "overlay+files", (r.status, r.steps, r.error, tok.decode(r.trace.ids)[-800:])
            assert r.container_id in containers
            # The episode's own command saw its container's cgroup: its commands ran in that container.
            seen = tok.decode([i for i, m in zip(r.trace.ids, r.trace.mask) if m == 0])
            assert f"libpod-{r.container_id}" in seen, seen[-600:]
        assert not any(lab[NODE_LABEL] == head.node_id for lab in containers.values())
    finally:
        if worker is not None:
            ray.get(worker.close.remote(), timeout=300)
            ray.kill(worker)
        placement.remove()
        from tmax.sandbox.cleanup import remove_labelled

        remove_labelled(labels)
