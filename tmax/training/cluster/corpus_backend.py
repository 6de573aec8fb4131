"""Corpus jobs on a Ray cluster: the Ray backend of `tasks.job_runner`.

The cluster is the trainer's (`training.cluster.launch.connect`): `--address` /
`RAY_ADDRESS` connects to a running one, without either a private local cluster starts.
Each job is a Ray task with `cpus_per_job` CPUs and, optionally, a custom resource that
only the nodes able to run the jobs advertise (e.g. start nodes with podman as
`ray start ... --resources '{"tmax_sandbox": 8}'` and pass `resource="tmax_sandbox"`), so
jobs land only there. The runner keeps `slots` jobs in flight: the cluster's CPUs over
`cpus_per_job`. Task directories and the work directory must be on a filesystem every
node sees at the same path (as the trainer's run directory is).
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

from tmax.training.cluster.launch import connect
from tmax.training.config import ClusterConfig


def _call(fn: Callable[..., dict], *args: Any) -> tuple[dict, str]:
    import ray

    return fn(*args), ray.get_runtime_context().get_node_id()


class RayBackend:
    def __init__(self, address: str | None = None, cpus_per_job: float = 1.0, resource: str | None = None):
        import ray

        self._cluster = connect(ClusterConfig(address=address))
        total = ray.cluster_resources()
        cap = total.get(resource, 0.0) if resource else total.get("CPU", 1.0) / cpus_per_job
        if resource and not cap:
            raise RuntimeError(f"no node of the Ray cluster advertises the resource {resource!r}")
        self.slots = max(1, int(cap))
        self.nodes = sum(1 for n in ray.nodes() if n["Alive"])
        opts: dict = {"num_cpus": cpus_per_job, "max_retries": 0}
        if resource:
            opts["resources"] = {resource: 1}
        self._remote = ray.remote(**opts)(_call)
        self.jobs_per_node: Counter = Counter()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., dict], *args: Any) -> Future:
        """The job's result; the node it ran on is counted in `jobs_per_node`."""
        out: Future = Future()

        def done(ray_future: Future) -> None:
            try:
                result, node = ray_future.result()
            except BaseException as e:  # the job raised, or its worker died
                out.set_exception(e)
                return
            with self._lock:
                self.jobs_per_node[node] += 1
            out.set_result(result)

        self._remote.remote(fn, *args).future().add_done_callback(done)
        return out

    def close(self) -> None:
        self._cluster.shutdown()  # leaves a cluster this process had joined before running
