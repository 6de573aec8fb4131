"""Every Ray actor of `tmax learn`, for every placement: one machine is a one-node layout.

The actors are plain classes, each in its own module (`learner_rank.LearnerRank`,
`engine_actor.EngineActor`, `rollout_worker.RolloutWorker`), wrapped with `ray.remote`
here, where they are created; Ray is imported only then.

* `LearnerGroup`: learner ranks 0..R-1 (`LearnerRank`), joined in one torch.distributed
  group (gloo on CPU, NCCL on GPU) when R > 1. `train_step(samples)` gives every rank its
  token-balanced share (`learner.packing.shard`); the learner all-reduces the global
  loss-token count, so the loss stays the exact token mean of the whole batch. Calls
  return rank 0's ref (metrics are already reduced over ranks).
* `EngineGroup`: N vLLM engine actors (`EngineActor`), restarted by Ray when they die (an
  actor whose vLLM server died exits, so a dead server counts). A restarted engine reloads
  the last weights it was pushed at their version (object-store transport; on a process
  group, `training.weights.learner_side.WeightSync` re-forms the group at the next sync).
* rollout workers (the generator's `EpisodeWorker`, `training.generator`: a `RolloutWorker`
  for Harbor tasks) anywhere with free CPU, restarted by Ray; worker i
  samples from engine i mod N through a `FailoverSampler` (`training.cluster.failover`),
  from the next live engine while that one is down, waiting for a restart when none is.
  A dead worker's episodes fail with a Ray actor error: re-queued, never scored, and the
  loop removes the containers it left (run label).

Without a placement: plain CPU options on the local cluster (1 learner rank, 1 engine,
`run.rollout_workers` workers); with one, the plan's counts and bundles (`placement.json`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

from tmax.common.records import CheckpointExtra
from tmax.training.cluster.engine_actor import EngineActor
from tmax.training.cluster.failover import FailoverSampler, WorkersDown
from tmax.training.cluster.learner_rank import LearnerRank
from tmax.training.cluster.reservation import Placement
from tmax.training.cluster.sandbox_nodes import worker_slots
from tmax.training.generator import WorkerSpec

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from tmax.training.config import LearnConfig
    from tmax.training.learner.learner import LearnerConfig

# Ray threads per rollout worker beyond its episode slots, so prewarm calls are not
# queued behind running episodes.
PREWARM_CALL_SLOTS = 2


class LearnerGroup:
    """The learner ranks, driven as one: each call goes to every rank and returns rank 0's
    ref; the other ranks' refs of a call are checked at the next call."""

    def __init__(self, ranks: list[ActorHandle], setups: list[ObjectRef] | None = None):
        self.ranks = ranks
        self.setups = setups or []  # refs that fail when a rank cannot start
        self._others: list[ObjectRef] = []

    @classmethod
    def start(cls, options: list[dict], model_dir: str, lcfg: LearnerConfig, resume: str | None,
              threads: int | None) -> "LearnerGroup":
        import ray

        rank_actor = ray.remote(LearnerRank)
        ranks = [rank_actor.options(**o).remote(threads) for o in options]
        host, port = ray.get(ranks[0].rendezvous.remote())
        return cls(ranks, [a.setup.remote(r, len(ranks), host, port, model_dir, lcfg, resume)
                           for r, a in enumerate(ranks)])

    @property
    def rank0(self) -> ActorHandle:
        return self.ranks[0]

    def _all(self, call: Callable[[ActorHandle], ObjectRef]) -> ObjectRef:
        import ray

        if self._others:
            ray.get(self._others)  # a failure on another rank surfaces here
        refs = [call(a) for a in self.ranks]
        self._others = refs[1:]
        return refs[0]

    def train_step(self, samples: list) -> ObjectRef:
        world = len(self.ranks)
        return self._all(lambda a: a.train_step.remote(samples, world))

    def named_weights(self) -> ObjectRef:
        return self._all(lambda a: a.named_weights.remote())

    def prepare_weights(self, version: int) -> ObjectRef:
        # Every rank gathers (a collective); rank 0's ref carries the update.
        return self._all(lambda a: a.prepare_weights.remote(version))

    def save(self, path: str, step: int, extra: CheckpointExtra) -> ObjectRef:
        return self._all(lambda a: a.save.remote(path, step, extra))

    def restore(self, path: str, lr_scale: float = 1.0) -> ObjectRef:
        """Every rank back to checkpoint `path` (the collapse guard's rollback)."""
        return self._all(lambda a: a.restore.remote(path, lr_scale))

    def kill(self) -> None:
        import ray

        for a in self.ranks:
            try:
                ray.get(a.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(a)


class EngineGroup:
    """The engine actors; `info()`, `close()` and `sampler(i)` act on the group."""

    def __init__(self, engines: list[ActorHandle]):
        self.engines = engines

    @classmethod
    def start(cls, cfg: LearnConfig, model_dir: str, run_dir: str | Path, options: list[dict],
              tp: int | None = None) -> "EngineGroup":
        """Engine i gets seed `algo.seed + i` and its own work dir, each over `tp` GPUs;
        not waited for (`ready`)."""
        import ray

        engine_actor = ray.remote(EngineActor)
        engines = []
        for i, opts in enumerate(options):
            work = Path(run_dir).resolve() / ("engine" if len(options) == 1 else f"engine{i}")
            work.mkdir(parents=True, exist_ok=True)
            engines.append(engine_actor.options(**opts).remote(model_dir, cfg.engine, cfg.algo.seed + i, str(work), tp))
        return cls(engines)

    def ready(self) -> list[ObjectRef]:
        """Refs that fail when an engine could not start its server."""
        return [e.info.remote() for e in self.engines]

    def info(self) -> dict:
        """Engine 0's server: base URL, served model name, weights version."""
        import ray

        return ray.get(self.engines[0].info.remote())

    def sampler(self, index: int) -> FailoverSampler:
        return FailoverSampler(self.engines, index % len(self.engines))

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop every engine's vLLM server, best effort (on every exit path: an actor may already
        be dead, its server then dead with it)."""
        close_all(self.engines, timeout_s)

    def kill(self) -> None:
        import ray

        for e in self.engines:
            ray.kill(e)


def close_all(actors: list[ActorHandle], timeout_s: float) -> None:
    """`close()` on every actor at once, best effort (an actor may already be dead); waits
    up to `timeout_s` for them all."""
    import ray

    refs = []
    for a in actors:
        try:
            refs.append(a.close.remote())
        except Exception:
            pass
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception:
        pass


def _cpus(cfg: LearnConfig) -> float:
    return float(cfg.cluster.num_cpus or os.cpu_count() or 2)


def _tp(pl: Placement | None) -> int | None:
    """Each engine's tensor-parallel size: the plan's; None on one machine (vLLM's default)."""
    return pl.plan.tp if pl is not None else None


def engine_options(cfg: LearnConfig, pl: Placement | None) -> list[dict]:
    """`.options(...)` of every engine: the plan's bundles, or one engine on this node."""
    threads = cfg.run.concurrency + 4
    if pl is None:
        return [{"num_cpus": min(1.0, _cpus(cfg) / 4), "max_concurrency": threads, "max_restarts": -1}]
    return [pl.engine_options(i, max_restarts=-1, max_concurrency=threads) for i in range(pl.plan.engines)]


def learner_options(cfg: LearnConfig, pl: Placement | None) -> list[dict]:
    if pl is None:
        return [{"num_cpus": min(1.0, _cpus(cfg) / 4)}]
    return [pl.learner_options(r) for r in range(pl.plan.learner_ranks)]


def worker_options(cfg: LearnConfig, pl: Placement | None) -> list[dict]:
    rc = cfg.run
    threads = rc.slots_per_worker + PREWARM_CALL_SLOTS
    if pl is None:
        cpus = min(0.5, _cpus(cfg) / (4 * rc.rollout_workers))
        return [{"num_cpus": cpus, "max_concurrency": threads, "max_restarts": -1}] * rc.rollout_workers
    return [pl.sandbox_options(i, max_restarts=-1,
                               max_concurrency=worker_slots(pl, i, rc.slots_per_worker) + PREWARM_CALL_SLOTS)
            for i in range(pl.plan.sandbox_workers)]


def start_engines(cfg: LearnConfig, model_dir: str, run_dir: str | Path, pl: Placement | None = None) -> EngineGroup:
    """The engines of the layout, serving `model_dir`, ready (servers healthy) on return."""
    import ray

    engines = EngineGroup.start(cfg, model_dir, run_dir, engine_options(cfg, pl), _tp(pl))
    try:
        ray.get(engines.ready())
    except BaseException:
        engines.close()
        engines.kill()
        raise
    return engines


@dataclass
class Actors:
    """Everything a run drives: the learner ranks, the engines, the rollout workers."""

    learner: LearnerGroup
    engines: EngineGroup
    workers: list[ActorHandle]
    own_engines: bool = True  # False: the caller's engines, which it stops itself
    labels: dict[str, str] | None = None  # every container of the run carries them (`run_labels`)
    workers_down: WorkersDown = field(default_factory=WorkersDown)  # restarting under Ray

    def worker_failed(self, index: int, sent_at: float) -> bool:
        """An episode failed with worker `index`'s death: the worker rests while Ray restarts
        it and the containers of the episodes it ran are removed. True when the episode ran
        (sent before the failure was first seen), False when the restarting worker refused it."""
        self.remove_orphaned_containers()
        return self.workers_down.failed(index, sent_at)

    def remove_orphaned_containers(self) -> list[str]:
        """The run's containers on this node whose worker process is gone (a worker Ray
        killed or restarted, or the previous process of a resumed run): removed, named."""
        from tmax.sandbox.cleanup import remove_orphaned

        return remove_orphaned(self.labels).containers if self.labels else []

    def close(self, keep_engines: bool = False) -> None:
        """Close the workers' warm pools (their idle containers), kill every actor and remove
        the run's containers left on this node; engines the run started are stopped unless
        `keep_engines`."""
        import ray

        close_all(self.workers, 120.0)
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        if self.labels:
            # The run is over: any container of it on this node is a leftover, whoever
            # started it (a prewarm that raced the pool's close, a worker that did not answer).
            from tmax.sandbox.cleanup import remove_labelled

            remove_labelled(self.labels)
        if self.own_engines and not keep_engines:
            self.engines.close()
            self.engines.kill()
        self.learner.kill()


def start_actors(cfg: LearnConfig, model_dir: str, resume_from: str | None, run_dir: str | Path, lcfg: LearnerConfig,
                 worker: WorkerSpec, labels: dict[str, str] | None, pl: Placement | None = None,
                 engines: EngineGroup | None = None) -> Actors:
    """Create and wait for every actor of the layout; the rollout workers are a generator's
    `worker` (`training.generator`), their sandboxes marked with `labels`. `engines` reuses
    running engines (already serving `model_dir`)."""
    import ray

    if engines is not None and pl is not None:
        raise ValueError("a placed run starts its own engines; running engines cannot be reused with a placement")
    own = engines is None
    learner: LearnerGroup | None = None
    workers: list = []
    try:
        learner = LearnerGroup.start(learner_options(cfg, pl), model_dir, lcfg, resume_from, cfg.run.torch_threads)
        engines = engines or EngineGroup.start(cfg, model_dir, run_dir, engine_options(cfg, pl), _tp(pl))
        # The workers start while the engines do (a worker needs its engine only for its
        # first episode): their imports overlap the vLLM start instead of following it.
        worker_actor = ray.remote(worker.cls)
        workers = [worker_actor.options(**o).remote(
            sampler=engines.sampler(i), slots=worker_slots(pl, i, cfg.run.slots_per_worker), **worker.kwargs)
            for i, o in enumerate(worker_options(cfg, pl))]
        # Start-up errors of any rank or engine surface here, before any episode runs.
        ray.get(learner.setups + (engines.ready() if own else []))
        actors = Actors(learner, engines, workers, own, labels)
        actors.remove_orphaned_containers()  # a killed earlier process of this run left them
        if pl is not None:
            pl.write(Path(run_dir) / "placement.json", actors)
    except BaseException:
        Actors(learner or LearnerGroup([]), engines or EngineGroup([]), workers, own, labels).close()
        raise
    return actors


def _import_actor_libraries() -> None:
    import torch  # noqa: F401 - what every actor of a run imports first
    import transformers  # noqa: F401


def warm_worker_processes(n: int) -> list[ActorHandle]:
    """`n` tasks that import torch and transformers in Ray's idle worker processes, not
    waited for. Actors created later take idle workers from Ray's pool, so those whose
    process already has the imports skip them (several seconds each on a loaded 2-core
    machine): the recipe runs them while its engine starts on one thread, before the
    learner and the rollout workers are created."""
    import ray

    warm = ray.remote(num_cpus=0)(_import_actor_libraries)
    return [warm.remote() for _ in range(n)]
