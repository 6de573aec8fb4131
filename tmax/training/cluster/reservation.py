"""The plan meets a live Ray cluster: check that its nodes can hold the plan
(`check_resources`, `check_live_cluster`), then reserve the placement groups that pin
learners, engines and sandbox workers to their nodes (`reserve` -> `Placement`).

The plan itself is pure Python (`placement`); only this module talks to Ray (imported inside
the functions that need it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tmax.training.cluster.placement import ROLE_INFER, ROLE_TRAIN, PlacementPlan
from tmax.training.cluster.sandbox_nodes import SandboxPlacement, check_sandbox_nodes, sandbox_groups


# -- resource check ----------------------------------------------------------------------


@dataclass
class NodeInfo:
    node_id: str
    address: str
    resources: dict[str, float]

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


def nodes_from_ray(ray_nodes: list[dict]) -> list[NodeInfo]:
    """`ray.nodes()` entries of alive nodes, as NodeInfo."""
    return [
        NodeInfo(str(n.get("NodeID", "")), str(n.get("NodeManagerAddress", "?")), dict(n.get("Resources", {})))
        for n in ray_nodes
        if n.get("Alive", n.get("alive", False))
    ]


def uses_role_resources(nodes: list[NodeInfo]) -> bool:
    """True when tmax started the cluster (nodes carry `tmax_train` / `tmax_infer`)."""
    return any(ROLE_TRAIN in n.resources or ROLE_INFER in n.resources for n in nodes)


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(res.items()))


def check_resources(plan: PlacementPlan, nodes: list[NodeInfo]) -> list[str]:
    """What the cluster lacks for this plan; an empty list means it fits.

    Mirrors how the placement groups are scheduled: every learner bundle and every
    engine bundle needs its own node (STRICT_SPREAD within a role), both roles may share
    a node only when the plan is colocated, and sandbox workers take leftover CPUs.
    Each message names the role, how many nodes are needed, how many qualify and why
    the others do not.
    """
    problems: list[str] = []
    roles = uses_role_resources(nodes)
    lb, eb = plan.learner_bundle(roles), plan.engine_bundle(roles)
    free = {n.node_id: dict(n.resources) for n in nodes}
    if len(nodes) < (1 if plan.colocated else plan.nodes) + plan.sandbox_nodes:
        problems.append(f"nodes: the plan needs {plan.nodes + plan.sandbox_nodes} node(s), the cluster has"
                        f" {len(nodes)} alive")

    def place(bundle: dict[str, float], count: int, role: str, exclude: set[str]) -> set[str]:
        # Greedy: most GPUs first, so the check agrees with what a STRICT_SPREAD
        # placement group can achieve on these totals.
        order = sorted(nodes, key=lambda n: (-n.resources.get("GPU", 0.0), -n.resources.get("CPU", 0.0)))
        chosen: set[str] = set()
        reasons: list[str] = []
        for n in order:
            if len(chosen) == count:
                break
            if n.node_id in exclude:
                continue
            if _fits(free[n.node_id], bundle):
                _take(free[n.node_id], bundle)
                chosen.add(n.node_id)
            else:
                short = {
                    k: v - free[n.node_id].get(k, 0.0) for k, v in bundle.items() if free[n.node_id].get(k, 0.0) + 1e-9 < v
                }
                reasons.append(f"{n.name} lacks {_fmt(short)}")
        if len(chosen) < count:
            msg = (
                f"{role}: need {count} node(s) with {_fmt(bundle)} each, found {len(chosen)}"
                + (f"; {'; '.join(reasons)}" if reasons else "")
            )
            problems.append(msg)
        return chosen

    train = place(lb, plan.train_nodes if not plan.colocated else 1, "learners", set())
    place(eb, plan.infer_nodes if not plan.colocated else 1, "engines", set() if plan.colocated else train)
    if plan.sandbox_nodes:
        return problems + check_sandbox_nodes(plan.sandbox_nodes, plan.cpus_per_sandbox_worker, nodes)
    cpu_left = sum(max(f.get("CPU", 0.0), 0.0) for f in free.values())
    need_cpu = plan.sandbox_workers * plan.cpus_per_sandbox_worker
    if cpu_left + 1e-9 < need_cpu:
        problems.append(
            f"sandbox workers: need {need_cpu:g} CPU for {plan.sandbox_workers} worker(s) after learners and engines,"
            f" {cpu_left:g} CPU left"
        )
    return problems


def check_live_cluster(plan: PlacementPlan) -> list[str]:
    """`check_resources` against the connected Ray cluster."""
    import ray

    return check_resources(plan, nodes_from_ray(ray.nodes()))


# -- Ray placement groups ----------------------------------------------------------------


@dataclass
class Placement:
    """Reserved placement groups plus the node each bundle landed on."""

    plan: PlacementPlan
    learner_pg: Any
    engine_pg: Any
    learner_nodes: list[str]  # node id of learner bundle i
    engine_nodes: list[str]
    sandboxes: SandboxPlacement | None = None  # with sandbox nodes: a bundle (a rollout worker) on each

    def learner_options(self, rank: int, **extra: Any) -> dict[str, Any]:
        """`.options(...)` kwargs that put learner `rank` on its train node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= rank < self.plan.learner_ranks:
            raise IndexError(f"learner rank {rank} outside 0..{self.plan.learner_ranks - 1}")
        opts: dict[str, Any] = {
            "num_cpus": self.plan.cpus_per_learner,
            "num_gpus": 1 if self.plan.use_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.learner_pg,
                placement_group_bundle_index=rank // self.plan.learners_per_node,
            ),
        }
        opts.update(extra)
        return opts

    def engine_options(self, index: int, **extra: Any) -> dict[str, Any]:
        """`.options(...)` kwargs for engine `index`. With TP > 1 the engine actor takes
        no GPU itself: its vLLM workers claim `tp` GPUs of the same bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= index < self.plan.engines:
            raise IndexError(f"engine {index} outside 0..{self.plan.engines - 1}")
        opts: dict[str, Any] = {
            "num_cpus": self.plan.cpus_per_engine,
            "num_gpus": (1 if self.plan.tp == 1 else 0) if self.plan.use_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.engine_pg,
                placement_group_bundle_index=index // self.plan.engines_per_node,
                placement_group_capture_child_tasks=True,
            ),
        }
        opts.update(extra)
        return opts

    def write(self, path: Any, actors: Any) -> dict:
        """Plan, bundle nodes and the node every actor (`training.cluster.actors.Actors`)
        reports it runs on, written atomically to `path`."""
        import ray

        from tmax.common.files import write_json_atomic

        out = {
            "plan": self.plan.to_dict(),
            "learner_bundle_nodes": self.learner_nodes,
            "engine_bundle_nodes": self.engine_nodes,
            "learner_rank_nodes": ray.get([a.node_id.remote() for a in actors.learner.ranks]),
            "engine_nodes": ray.get([e.node_id.remote() for e in actors.engines.engines]),
            "worker_nodes": ray.get([w.node_id.remote() for w in actors.workers]),
            "sandbox_bundle_nodes": self.sandboxes.nodes if self.sandboxes else [],
        }
        write_json_atomic(path, out)
        return out

    def sandbox_options(self, index: int = 0, **extra: Any) -> dict[str, Any]:
        """Rollout worker `index`: on its sandbox node when the plan has them, else anywhere."""
        if self.sandboxes is not None:
            return self.sandboxes.worker_options(index, self.plan.cpus_per_sandbox_worker, **extra)
        opts: dict[str, Any] = {"num_cpus": self.plan.cpus_per_sandbox_worker}
        opts.update(extra)
        return opts

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in (self.learner_pg, self.engine_pg, *([self.sandboxes.pg] if self.sandboxes else [])):
            try:
                remove_placement_group(pg)
            except Exception:  # already gone with the cluster
                pass


class PlacementTimeout(RuntimeError):
    """Placement groups did not become ready: the cluster cannot hold the plan."""


def reserve(plan: PlacementPlan, timeout_s: float = 300.0) -> Placement:
    """Create and wait for the learner and engine placement groups.

    Call `check_live_cluster` first: a placement group that cannot be scheduled waits
    forever without saying why, so the timeout error repeats the check.
    """
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    roles = uses_role_resources(nodes_from_ray(ray.nodes()))
    n_train = 1 if plan.colocated else plan.train_nodes
    n_infer = 1 if plan.colocated else plan.infer_nodes
    lpg = placement_group([plan.learner_bundle(roles)] * n_train, strategy="STRICT_SPREAD", name="tmax-learners")
    epg = placement_group([plan.engine_bundle(roles)] * n_infer, strategy="STRICT_SPREAD", name="tmax-engines")
    groups = [lpg, epg] + sandbox_groups(plan.sandbox_nodes, plan.cpus_per_sandbox_worker)
    try:
        ray.get([pg.ready() for pg in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for pg in groups:
            ray.util.remove_placement_group(pg)
        missing = check_live_cluster(plan)
        raise PlacementTimeout(
            f"placement groups not ready after {timeout_s:g}s"
            + (": " + "; ".join(missing) if missing else " (resources are in use by other jobs?)")
        ) from None

    def bundle_nodes(pg: Any) -> list[str]:
        table = placement_group_table(pg)["bundles_to_node_id"]
        return [table[i] for i in sorted(table)]

    sandboxes = SandboxPlacement.of(groups[2], bundle_nodes(groups[2])) if plan.sandbox_nodes else None
    return Placement(plan, lpg, epg, bundle_nodes(lpg), bundle_nodes(epg), sandboxes)
