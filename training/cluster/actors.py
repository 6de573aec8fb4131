"""The one-machine loop's actors, placed per a `training.cluster.placement` plan.

`loop.train(..., placement=pl)` asks `start_placed` for its learner, engine and
rollout workers instead of creating one of each. What comes back drives like the
single-actor versions, so the loop itself does not change:

* `LearnerGroup`: learner ranks 0..R-1, each a Ray actor in the train bundles, joined in
  one torch.distributed group (gloo on CPU, NCCL on GPU). `train_step.remote(samples)`
  gives every rank its token-balanced share (`learner.shard`); the learner all-reduces
  the global loss-token count, so the loss stays the exact token mean of the whole
  batch. It returns rank 0's ref (metrics are already reduced over ranks).
* `EngineGroup`: N vLLM engine actors in the inference bundles, restarted by Ray when
  they die. `training.weights.learner_side.WeightSync` brings them the learner's weights
  (and re-forms a gloo / NCCL weight group with an engine Ray restarted).
* rollout workers anywhere with free CPU (`sandbox_options`), restarted when they die;
  worker i samples from engine i mod N, and from the next live engine while that one is
  down. An episode whose worker died fails with a Ray actor error, which the loop
  re-queues (never scores).

Where every actor landed is written to `placement.json` in the run directory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from agents.records import write_json_atomic
from training.cluster.placement import Placement

# Gloo / NCCL collectives of the learner group give up after this long (a dead rank).
GROUP_TIMEOUT_S = 600.0


class _Call:
    """`obj.method.remote(...)`, the call shape the loop uses for actor handles."""

    def __init__(self, fn: Any):
        self.remote = fn


class FailoverSampler:
    """`agents.policy.TokenSampler` over the engine actors (picklable): turns go to the
    worker's own engine, and while it is down (dead, or restarting under Ray) to the
    next live one, so an engine failure costs no episode. Every turn keeps the logprobs
    and the weights version of the engine that sampled it, so mixing engines within an
    episode is exact for the loss."""

    def __init__(self, engines: list[Any], first: int):
        self.engines = engines
        self.first = first

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None):
        import ray

        from agents.policy import ModelError

        errors = []
        for k in range(len(self.engines)):
            engine = self.engines[(self.first + k) % len(self.engines)]
            try:
                return ray.get(engine.sample.remote(list(prompt_ids), max_tokens, temperature, top_p, seed))
            except ray.exceptions.RayActorError as e:
                errors.append(type(e).__name__)
        raise ModelError(f"every engine actor is down ({', '.join(errors)})")


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@functools.lru_cache(maxsize=None)
def _rank_class():
    import ray

    from training.weights.learner_side import WeightSourceMixin

    @ray.remote
    class LearnerRank(WeightSourceMixin):
        """One data-parallel learner rank (FSDP2-sharded or replicated, per
        `LearnerConfig.strategy`); rank 0 is also rank 0 of the weight group for a
        process-group transport."""

        def __init__(self, threads: int | None):
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.learner: Any = None
            self.rank = 0

        def node_id(self) -> str:
            return _node_id()

        def rendezvous(self) -> tuple[str, int]:
            from training.net import free_port, node_ip

            return node_ip(), free_port()

        def setup(self, rank: int, world: int, host: str, port: int, model_dir: str, lcfg: Any,
                  resume: str | None) -> int:
            from training.learner.parallel import init_learner_group
            from training.learner.learner import Learner

            ctx = init_learner_group(rank, world, host, port, timeout_s=GROUP_TIMEOUT_S)
            self.rank = rank
            dp = group_data_parallel(ctx, lcfg.strategy)
            self.learner = Learner.load(resume, lcfg, dp) if resume else Learner(model_dir, lcfg, dp)
            return rank

        def train_step(self, samples: list, world: int) -> dict:
            from training.learner.packing import shard

            return self.learner.train_step(shard(samples, self.rank, world))

        def named_weights(self) -> dict:
            w = self.learner.named_weights()  # a collective once the backend shards
            # CPU tensors: engines on other nodes read them from the object store.
            return {k: v.cpu() for k, v in w.items()} if self.rank == 0 else {}

        def save(self, path: str, step: int, extra: dict) -> str:
            return str(self.learner.save(path, step, extra))

        def close(self) -> None:
            from training.learner.parallel import destroy_learner_group

            destroy_learner_group()

    return LearnerRank


def group_data_parallel(ctx: Any, strategy: str = "fsdp") -> Any:
    """The learner's `DataParallel` for a rank context: none for one rank, else
    `strategy` ("fsdp" or "replicate", `LearnerConfig.strategy`) over the group."""
    from training.learner.parallel import data_parallel

    return data_parallel(ctx, strategy)


class LearnerGroup:
    def __init__(self, ranks: list[Any]):
        self.ranks = ranks
        self._others: list[Any] = []  # refs of ranks 1.. from the last call, checked on the next
        self.train_step = _Call(self._train_step)
        self.named_weights = _Call(lambda: self._all(lambda a: a.named_weights.remote()))
        self.save = _Call(lambda *args: self._all(lambda a: a.save.remote(*args)))
        # Every rank gathers (a collective); rank 0's ref carries the update.
        self.prepare_weights = _Call(lambda version: self._all(lambda a: a.prepare_weights.remote(version)))

    def _all(self, call: Any) -> Any:
        import ray

        if self._others:
            ray.get(self._others)  # a failure on another rank surfaces here
        refs = [call(a) for a in self.ranks]
        self._others = refs[1:]
        return refs[0]

    def _train_step(self, samples: list) -> Any:
        world = len(self.ranks)
        return self._all(lambda a: a.train_step.remote(samples, world))

    def kill(self) -> None:
        import ray

        for a in self.ranks:
            try:
                ray.get(a.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(a)


@functools.lru_cache(maxsize=None)
def _gather():
    import ray

    @ray.remote(num_cpus=0)
    def slowest(refs: list) -> float:
        """One ref for a call on every engine (`close`); an engine that died is skipped."""
        seconds = []
        for ref in refs:
            try:
                seconds.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                continue
        if refs and not seconds:
            raise RuntimeError("no engine took the weights: every engine actor died")
        return max([s for s in seconds if s is not None], default=0.0)

    return slowest


class EngineGroup:
    def __init__(self, engines: list[Any]):
        self.engines = engines
        self.close = _Call(lambda: _gather().remote([e.close.remote() for e in self.engines]))
        self.info = _Call(lambda: self.engines[0].info.remote())

    def kill(self) -> None:
        import ray

        for e in self.engines:
            ray.kill(e)


def start_placed(cfg: Any, pl: Placement, model_dir: str, resume_from: str | None, run_dir: str | Path,
                 actor_classes: tuple, lcfg: Any, images: dict) -> tuple[LearnerGroup, EngineGroup, list]:
    """Create and wait for every actor of the plan; returns (learners, engines, workers).
    `images` maps task dirs to their resolved images (built on the driver's node)."""
    import ray

    _, EngineActor, RolloutWorker = actor_classes
    plan, rc = pl.plan, cfg.run
    run_dir = Path(run_dir).resolve()
    LearnerRank = _rank_class()
    ranks: list = []
    engines: list = []
    workers: list = []
    try:
        ranks = [LearnerRank.options(**pl.learner_options(r)).remote(rc.torch_threads) for r in range(plan.learner_ranks)]
        host, port = ray.get(ranks[0].rendezvous.remote())
        setups = [a.setup.remote(r, len(ranks), host, port, model_dir, lcfg, resume_from) for r, a in enumerate(ranks)]
        for i in range(plan.engines):
            work = run_dir / f"engine{i}"
            work.mkdir(parents=True, exist_ok=True)
            opts = pl.engine_options(i, max_restarts=-1, max_concurrency=rc.concurrency + 4)
            engines.append(EngineActor.options(**opts).remote(model_dir, cfg.engine, cfg.algo.seed + i, str(work)))
        # Start-up errors of any rank or engine surface here, before any episode runs.
        ray.get(setups + [e.info.remote() for e in engines])
        workers = [
            RolloutWorker.options(**pl.sandbox_options(max_restarts=-1, max_concurrency=rc.slots_per_worker + 2))
            .remote(model_dir, cfg.rollout, FailoverSampler(engines, i % len(engines)), images, None,
                    rc.slots_per_worker)
            for i in range(plan.sandbox_workers)
        ]
        write_placement(run_dir / "placement.json", pl, ranks, engines, workers)
    except BaseException:
        # Engines own vLLM server processes: close them before the actors go.
        try:
            ray.get([e.close.remote() for e in engines], timeout=60)
        except Exception:
            pass
        for a in workers + engines + ranks:
            ray.kill(a)
        raise
    return LearnerGroup(ranks), EngineGroup(engines), workers


def write_placement(path: Path, pl: Placement, ranks: list, engines: list, workers: list) -> dict:
    """Plan, bundle nodes and the node every actor reports it runs on, written atomically."""
    import ray

    out = {
        "plan": pl.plan.to_dict(),
        "learner_bundle_nodes": pl.learner_nodes,
        "engine_bundle_nodes": pl.engine_nodes,
        "learner_rank_nodes": ray.get([a.node_id.remote() for a in ranks]),
        "engine_nodes": ray.get([e.node_id.remote() for e in engines]),
        "worker_nodes": ray.get([w.node_id.remote() for w in workers]),
    }
    write_json_atomic(path, out)
    return out
