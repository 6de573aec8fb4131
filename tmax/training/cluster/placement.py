"""Placement plan for `tmax learn --nodes N`: which node does what, and how Ray pins it.

A plan splits N nodes into training nodes (learner ranks, one per GPU) and inference
nodes (vLLM engines of `tp` GPUs each); sandbox workers go wherever CPU is free. The
default split follows the paper's runs: 8 nodes = 2 train + 6 inference, 4 nodes =
2 + 2, and one train node below four.

Sandbox nodes (`training.cluster.sandbox_nodes`): CPU nodes beyond the N for the rollout workers.

Ray pinning: one placement-group bundle per node and role. Learner bundles hold all
learner GPUs of a node and are STRICT_SPREAD (one bundle per distinct node, as in the
open-instruct fork); engine bundles are the same per inference node. Learner rank r uses
bundle r // learners_per_node, engine e uses bundle e // engines_per_node. When tmax
starts the cluster itself it gives every node a role resource (`tmax_train` or
`tmax_infer`, 1 unit) and every bundle asks for one unit, so roles land on exactly the
intended nodes even on CPU-only clusters; on a cluster started by someone else the GPU
counts alone do the pinning (learner bundles take whole nodes' GPUs).

Pure Python apart from the functions that talk to a live cluster (`ray` is imported
inside them), so `--dry-run` works without Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tmax.training.cluster.sandbox_nodes import (
    ROLE_SANDBOX, SandboxPlacement, check_sandbox_nodes, sandbox_groups, sandbox_header, sandbox_lines,
)
from tmax.training.weights.transports import describe_transport

if TYPE_CHECKING:
    from tmax.training.config import LearnConfig

ROLE_TRAIN = "tmax_train"
ROLE_INFER = "tmax_infer"
# CPUs reserved next to each GPU actor; the paper reserves 10 per learner GPU, most of
# which feed data loading. Sandbox workers need their own CPUs on top.
GPU_LEARNER_CPUS = 4.0
GPU_ENGINE_CPUS = 4.0
CPU_LEARNER_CPUS = 1.0
CPU_ENGINE_CPUS = 1.0


class PlanError(ValueError):
    """A placement request that cannot be satisfied by any cluster (bad flag values)."""


def default_train_nodes(nodes: int) -> int:
    """Training nodes when the user does not say: 1 below 4 nodes, else a quarter, at least 2."""
    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    if nodes == 1:
        return 1  # one machine: learners and engines share the node
    if nodes < 4:
        return 1
    return max(2, nodes // 4)


@dataclass
class PlacementPlan:
    nodes: int
    gpus_per_node: int
    train_nodes: int
    infer_nodes: int
    learners_per_node: int
    engines_per_node: int
    tp: int
    sandbox_workers: int
    cpus_per_learner: float
    cpus_per_engine: float
    cpus_per_sandbox_worker: float = 1.0
    colocated: bool = False  # one node: learners and engines share it
    notes: list[str] = field(default_factory=list)
    sandbox_nodes: int = 0  # CPU nodes beyond `nodes` for the rollout workers and their containers

    # -- derived sizes ---------------------------------------------------------------
    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def learner_ranks(self) -> int:
        return self.train_nodes * self.learners_per_node

    @property
    def engines(self) -> int:
        return self.infer_nodes * self.engines_per_node

    def learner_bundle(self, role_resources: bool) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.cpus_per_learner * self.learners_per_node}
        if self.use_gpu:
            b["GPU"] = float(self.learners_per_node)
        if role_resources:
            b[ROLE_TRAIN] = 1.0
        return b

    def engine_bundle(self, role_resources: bool) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.cpus_per_engine * self.engines_per_node}
        if self.use_gpu:
            b["GPU"] = float(self.engines_per_node * self.tp)
        if role_resources:
            b[ROLE_INFER] = 1.0
        return b

    def node_roles(self) -> list[list[str]]:
        """Roles of node i (index into the allocation's host list; node 0 runs the driver)."""
        sandboxes = [[ROLE_SANDBOX]] * self.sandbox_nodes
        if self.colocated:
            return [[ROLE_TRAIN, ROLE_INFER]] + sandboxes
        return [[ROLE_TRAIN]] * self.train_nodes + [[ROLE_INFER]] * self.infer_nodes + sandboxes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(learner_ranks=self.learner_ranks, engines=self.engines, use_gpu=self.use_gpu)
        return d

    # -- human output ----------------------------------------------------------------
    def describe(self, weight_transport: str = "auto") -> str:
        dev = f"{self.gpus_per_node} GPU/node" if self.use_gpu else "CPU only"
        lines = [f"placement plan: {self.nodes} node(s), {dev}" + sandbox_header(self.sandbox_nodes)]
        if self.colocated:
            lines.append(
                f"  node 0      train+infer  {self.learner_ranks} learner rank(s), "
                f"{self.engines} engine(s) x TP {self.tp}"
            )
        else:
            for i in range(self.train_nodes):
                lo = i * self.learners_per_node
                lines.append(
                    f"  node {i:<2}     train        learner ranks {lo}-{lo + self.learners_per_node - 1}"
                    f" ({self.learners_per_node} x {'GPU' if self.use_gpu else 'CPU process'})"
                )
            for j in range(self.infer_nodes):
                lo = j * self.engines_per_node
                lines.append(
                    f"  node {self.train_nodes + j:<2}     inference    engines {lo}-{lo + self.engines_per_node - 1}"
                    f" ({self.engines_per_node} x TP {self.tp})"
                )
        lines += [
            f"  learners:   {self.learner_ranks} rank(s) on {self.train_nodes} train node(s)"
            f" (torch.distributed data parallel over {'NCCL' if self.use_gpu else 'gloo'}), STRICT_SPREAD bundles",
            f"  engines:    {self.engines} x TP {self.tp} on {self.infer_nodes} inference node(s), STRICT_SPREAD bundles",
            *sandbox_lines(1 if self.colocated else self.nodes, self.sandbox_nodes, self.sandbox_workers,
                           self.cpus_per_sandbox_worker),
            f"  weight sync: learner rank 0 -> {self.engines} engine(s)"
            f" {describe_transport(weight_transport, self.use_gpu)} after every step",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def make_plan(
    nodes: int,
    gpus_per_node: int = 8,
    train_nodes: int | None = None,
    tp: int = 1,
    sandbox_workers: int | None = None,
    learners_per_node: int | None = None,
    engines_per_node: int | None = None,
    cpus_per_learner: float | None = None,
    cpus_per_engine: float | None = None,
    cpus_per_sandbox_worker: float = 1.0,
    sandbox_nodes: int = 0,
) -> PlacementPlan:
    """Build a plan from the CLI flags; every inconsistent combination is a `PlanError`.

    On GPU, a train node runs one learner rank per GPU and an inference node
    `gpus_per_node // tp` engines. With `gpus_per_node = 0` (CPU clusters, tests) the
    per-node counts default to 1 and can be set explicitly.
    """
    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    if gpus_per_node < 0:
        raise PlanError(f"--gpus-per-node must be >= 0, got {gpus_per_node}")
    if tp < 1:
        raise PlanError(f"tensor parallel size must be >= 1, got {tp}")
    notes: list[str] = []
    colocated = nodes == 1
    train_nodes, infer_nodes = _split_nodes(nodes, train_nodes)
    if gpus_per_node > 0:
        lpn, epn = _gpu_counts(gpus_per_node, tp, colocated, learners_per_node, engines_per_node, notes)
        cpl = GPU_LEARNER_CPUS if cpus_per_learner is None else cpus_per_learner
        cpe = GPU_ENGINE_CPUS if cpus_per_engine is None else cpus_per_engine
    else:
        lpn = learners_per_node or 1
        epn = engines_per_node or 1
        if tp != 1:
            raise PlanError("tensor parallelism needs GPUs (--gpus-per-node > 0)")
        cpl = CPU_LEARNER_CPUS if cpus_per_learner is None else cpus_per_learner
        cpe = CPU_ENGINE_CPUS if cpus_per_engine is None else cpus_per_engine
    if sandbox_nodes:
        sandbox_workers = sandbox_nodes  # one worker, and one pool, per sandbox node
    elif sandbox_workers is None:
        # One worker (holding several sandbox slots) per engine; the run config can raise it.
        sandbox_workers = epn * infer_nodes
    if sandbox_workers < 1:
        raise PlanError(f"sandbox workers must be >= 1, got {sandbox_workers}")
    return PlacementPlan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        train_nodes=train_nodes,
        infer_nodes=infer_nodes,
        learners_per_node=lpn,
        engines_per_node=epn,
        tp=tp,
        sandbox_workers=sandbox_workers,
        cpus_per_learner=cpl,
        cpus_per_engine=cpe,
        cpus_per_sandbox_worker=cpus_per_sandbox_worker,
        colocated=colocated,
        notes=notes,
        sandbox_nodes=sandbox_nodes,
    )


def plan_for(cfg: "LearnConfig") -> PlacementPlan | None:
    """The plan of a run's `[cluster]` section; None for a run on one machine without one."""
    c = cfg.cluster
    if c.nodes is None:
        return None
    return make_plan(c.nodes, c.gpus_per_node, c.train_nodes, tp=c.tp, sandbox_workers=cfg.run.rollout_workers,
                     learners_per_node=c.learners_per_node, engines_per_node=c.engines_per_node,
                     sandbox_nodes=c.sandbox_nodes)


def _split_nodes(nodes: int, train_nodes: int | None) -> tuple[int, int]:
    """(train nodes, inference nodes); one node does both."""
    if train_nodes is None:
        train_nodes = default_train_nodes(nodes)
    if nodes == 1:
        if train_nodes != 1:
            raise PlanError(f"--train-nodes {train_nodes} needs more than 1 node")
        return 1, 1
    if not 1 <= train_nodes <= nodes - 1:
        raise PlanError(
            f"--train-nodes must be between 1 and {nodes - 1} with --nodes {nodes} "
            f"(at least one node must run inference), got {train_nodes}"
        )
    return train_nodes, nodes - train_nodes


def _gpu_counts(gpus_per_node: int, tp: int, colocated: bool, learners_per_node: int | None,
                engines_per_node: int | None, notes: list[str]) -> tuple[int, int]:
    """(learner ranks, engines) per node on GPU nodes: a train node runs one rank per GPU and
    an inference node `gpus_per_node // tp` engines; one node splits its GPUs in half."""
    if colocated:
        if gpus_per_node < 2:
            raise PlanError("one node with 1 GPU cannot hold a learner and an engine; use 2+ GPUs or 2 nodes")
        lpn_default = gpus_per_node // 2
        epn_default = (gpus_per_node - lpn_default) // tp
    else:
        lpn_default = gpus_per_node
        epn_default = gpus_per_node // tp
    lpn = learners_per_node or lpn_default
    epn = engines_per_node or epn_default
    if epn < 1:
        raise PlanError(f"tensor parallel size {tp} does not fit in {gpus_per_node} GPU(s) per node")
    engine_gpus = epn * tp
    if colocated and lpn + engine_gpus > gpus_per_node:
        raise PlanError(f"{lpn} learner GPU(s) + {epn} x TP {tp} engine GPU(s) exceed {gpus_per_node} GPU(s)")
    if not colocated and (lpn > gpus_per_node or engine_gpus > gpus_per_node):
        raise PlanError(
            f"per node: {lpn} learner GPU(s) and {epn} x TP {tp} engine GPU(s) must each fit in {gpus_per_node}"
        )
    if not colocated and gpus_per_node % tp:
        notes.append(f"{gpus_per_node % tp} GPU(s) per inference node stay idle with TP {tp}")
    return lpn, epn


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
