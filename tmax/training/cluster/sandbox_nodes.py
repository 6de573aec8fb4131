"""Sandbox nodes (`tmax learn --nodes N --sandbox-nodes K`): CPU nodes that run the rollout
workers and every container of their episodes, never a learner or an engine.

Each of the K nodes carries the role resource `tmax_sandbox` (tmax gives it to the nodes
it starts after the N GPU nodes; a cluster started by someone else must give it to its
sandbox nodes, `ray start --resources '{"tmax_sandbox": 1}'`), and the learner and engine
bundles ask for their own roles, so neither can land there. One placement-group bundle per
sandbox node (STRICT_SPREAD) holds one rollout worker; its episodes at once are the node's
logical CPUs (what Ray counts for it): the node's pool, sized from its cores, its hosts shared
by whatever runs episodes on that node (`sandbox.overlay_pool`).

Pure Python apart from the functions that talk to a live cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

ROLE_SANDBOX = "tmax_sandbox"
NODE_LABEL = "io.tmax.node"  # the Ray node of the worker that started a container


def normal_priority() -> bool:
    """Every thread of this process back to niceness 0; False where lowering it is not allowed
    (not root, no CAP_SYS_NICE). Ray starts its workers at niceness 15 (`RAY_worker_niceness`):
    a rollout worker's shells, its podman service and the containers that service starts
    inherit it, so under load a training episode's commands got less CPU than a bench trial's
    (benchmarks/latency_parity.py). Threads started later inherit 0 from these."""
    import os

    ok = True
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except OSError:
            ok = False
    return ok


def sandbox_bundle(cpus_per_worker: float) -> dict[str, float]:
    return {"CPU": cpus_per_worker, ROLE_SANDBOX: 1.0}


def check_sandbox_nodes(count: int, cpus_per_worker: float, nodes: list[dict[str, Any]]) -> list[str]:
    """What the cluster lacks for `count` sandbox nodes (NodeInfo entries of `nodes`)."""
    if count == 0:
        return []
    found = [n for n in nodes if n.resources.get(ROLE_SANDBOX, 0.0) >= 1.0
             and n.resources.get("CPU", 0.0) + 1e-9 >= cpus_per_worker]
    if len(found) >= count:
        return []
    marked = [n for n in nodes if ROLE_SANDBOX in n.resources]
    why = f"; {len(marked)} node(s) carry {ROLE_SANDBOX}" if marked else (
        f"; no node carries the {ROLE_SANDBOX} resource (start sandbox nodes with"
        f" `ray start --resources '{{\"{ROLE_SANDBOX}\": 1}}'`, or let tmax start the cluster)")
    return [f"sandbox nodes: need {count} node(s) with 1 {ROLE_SANDBOX} and {cpus_per_worker:g} CPU each,"
            f" found {len(found)}{why}"]


@dataclass
class SandboxPlacement:
    """The sandbox nodes' placement group, the node of each bundle and its logical CPUs."""

    pg: PlacementGroup
    nodes: list[str]  # node id of bundle i (worker i)
    cpus: list[float]  # that node's logical CPUs: worker i's episodes at once

    def worker_options(self, index: int, cpus_per_worker: float, **extra: object) -> dict[str, object]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, object] = {"num_cpus": cpus_per_worker, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=index)}
        opts.update(extra)
        return opts

    def slots(self, index: int) -> int:
        return max(1, int(self.cpus[index]))

    @classmethod
    def of(cls, pg: PlacementGroup, nodes: list[str]) -> SandboxPlacement:
        """The ready group `pg`, its bundles on `nodes`: their logical CPUs as Ray counts them."""
        import ray

        totals = {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 1.0)) for n in ray.nodes()}
        return cls(pg, nodes, [totals.get(n, 1.0) for n in nodes])


def worker_slots(placement: object, index: int, default: int) -> int:
    """Episodes at once of rollout worker `index` (`placement`: a `placement.Placement`, or
    None on one machine): its sandbox node's CPUs, else `default` (`run.slots_per_worker`)."""
    sandboxes = getattr(placement, "sandboxes", None)
    return sandboxes.slots(index) if sandboxes is not None else default


def sandbox_groups(count: int, cpus_per_worker: float) -> list[PlacementGroup]:
    """The sandbox nodes' placement group, one bundle per node (not yet ready), in a list;
    none without sandbox nodes (Ray refuses a group of no bundles)."""
    from ray.util.placement_group import placement_group

    if not count:
        return []
    return [placement_group([sandbox_bundle(cpus_per_worker)] * count, strategy="STRICT_SPREAD", name="tmax-sandboxes")]


def sandbox_header(count: int) -> str:
    return f" + {count} sandbox node(s), CPU only" if count else ""


def sandbox_lines(first_index: int, count: int, workers: int, cpus_per_worker: float) -> list[str]:
    """The plan printout's lines for the sandboxes: the sandbox nodes, else where workers go."""
    if not count:
        return [f"  sandboxes:  {workers} worker(s), {cpus_per_worker:g} CPU each, anywhere with free CPU"]
    lines = [f"  node {first_index + i:<2}     sandbox      rollout worker {i}: every container of its episodes,"
             f" episodes at once = the node's CPUs" for i in range(count)]
    lines.append(f"  sandboxes:  {count} sandbox node(s), one rollout worker and one pool each; no container"
                 f" runs beside a learner or an engine")
    return lines
