"""`tmax data validate` on a real 2-node Ray cluster on one machine (`ray.cluster_utils.Cluster`,
as in tests/integration/test_multinode.py): the scheduler's Ray backend spreads the task jobs over both
nodes (each advertises the sandbox resource) and the results are the local run's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tmax.tasks.corpus.validate import validate_corpus  # noqa: E402
from tmax.training.cluster import launch as cluster  # noqa: E402
from tmax.training.cluster.corpus_backend import RayBackend  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.bwrap, pytest.mark.timeout(600)]
DATA = Path(__file__).parents[1] / "data" / "corpus" / "validate"
MB = 1024 * 1024


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_validate_a_small_corpus_on_two_ray_nodes(tmp_path):
    cluster.apply_ray_env()
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"tmax_sandbox": 1},
                                                      "include_dashboard": False, "object_store_memory": 80 * MB})
    c.add_node(num_cpus=1, resources={"tmax_sandbox": 1}, object_store_memory=80 * MB)
    try:
        ray.init(address=c.address)
        c.wait_for_nodes()
        root = tmp_path / "corpus"
        for name in ("good", "wrong-solution", "nop-passes", "no-solution"):
            shutil.copytree(DATA / name, root / name)
        shutil.copytree(DATA / "good", root / "good-2")
        backend = RayBackend(c.address, resource="tmax_sandbox")
        assert backend.slots == 2 and backend.nodes == 2
        reports = validate_corpus(root, tmp_path / "work", "bwrap", backend=backend)
        got = {r.task: (r.verdict, r.failed) for r in reports}
        assert got == {"good": ("ok", []), "good-2": ("ok", []), "wrong-solution": ("rejected", ["oracle"]),
                       "nop-passes": ("rejected", ["nop"]), "no-solution": ("unverified", ["oracle"])}
        assert len(backend.jobs_per_node) == 2 and sum(backend.jobs_per_node.values()) == 5
        assert len(list((tmp_path / "work" / "results").glob("*.json"))) == 5
    finally:
        ray.shutdown()
        c.shutdown()
