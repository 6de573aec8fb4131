"""A run's Ray, from start to end: the cluster (`launch.connect`, the one way tmax starts
or joins Ray) and, for a placed run, the check that the cluster can hold the plan and the
placement groups that pin learners and engines to their nodes. Everything is given back
when the run ends, however it ends."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from tmax.training.cluster import launch, placement
from tmax.training.cluster.launch import ClusterError
from tmax.training.cluster.placement import Placement, PlacementPlan
from tmax.training.config import LearnConfig

# "<run id>:<driver pid>" in the environment of every process a `tmax learn` driver starts
# (Ray's, the engines' vLLM servers): how a later driver of the run finds what a killed one left.
RUN_ENV = "TMAX_RUN_MARK"  # not under TMAX_LEARN_*, whose variables are config settings


def own_run_processes(run_dir: str | Path) -> list[int]:
    """Mark every process started from here on as this driver's, for the run in `run_dir`,
    and end the processes a dead driver of the same run left (a SIGKILLed driver's Ray
    processes, engines and vLLM servers, where they outlived it); returns their pids.
    Called before the run's Ray starts, so Ray's processes inherit the mark."""
    from tmax.common.proctree import end_orphans
    from tmax.training.rollout import RUN_LABEL, run_labels

    run_id = run_labels(run_dir)[RUN_LABEL]
    left = end_orphans(RUN_ENV, run_id)
    os.environ[RUN_ENV] = f"{run_id}:{os.getpid()}"
    return left


@contextmanager
def ray_session(cfg: LearnConfig, plan: PlacementPlan | None, log: Callable[[str], None]) -> Iterator[Placement | None]:
    """Ray per `cfg.cluster`; yields the reserved placement of `plan` (None without one)."""
    if plan is not None:
        log(plan.describe(cfg.engine.weight_transport))
    handle = launch.connect(cfg.cluster, plan)
    log(f"ray cluster: {handle.mode} ({handle.address})")
    try:
        if plan is None:
            yield None
            return
        missing = placement.check_live_cluster(plan)
        if missing:
            raise ClusterError("the Ray cluster cannot hold this plan:\n" + "\n".join(f"  - {m}" for m in missing))
        pl = placement.reserve(plan)
        try:
            log(f"placement groups ready: learners on {pl.learner_nodes}, engines on {pl.engine_nodes}")
            yield pl
        finally:
            pl.remove()
    finally:
        handle.shutdown()
