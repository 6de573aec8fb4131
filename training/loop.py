"""`tmax learn` on Ray: learner, inference engine and rollout workers as actors.

Ray from the start, even on one machine, so the multi-node layout is the same program
with other placements. The driver (this module's `train`) owns no heavy state: it hands
episode requests to rollout workers, gathers finished groups, lets the batching
accumulator decide what trains, and tells the learner to step and the engine to load
the new weights.

    prompts -> G episode requests per prompt -> RolloutWorker actors (Agent + TokenPolicy
    in a fresh sandbox, verifier reward) -> finished group -> BatchAccumulator (staleness,
    zero-std filter, active sampling) -> centered advantages -> LearnerActor.train_step
    (one optimizer step) -> EngineActor.push_weights (no restart) -> checkpoint every N.

Asynchrony: generation keeps running while the learner trains, bounded two ways: the
number of open prompts is fixed (each consumed group enqueues one new prompt), and data
whose oldest turn is more than `async_steps` versions behind the consuming step is
dropped by the accumulator. With `async_steps = 0` dispatch pauses during training.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import LearnConfig, dump_toml
from training.learner.packing import batch_samples
from training.rollout import (
    EpisodeRequest, InfraCounts, InfraError, Rollout, append_jsonl, prepare_tasks, prewarm_queue,
)
from training.weights.learner_side import WeightSync

# Every Ray process (driver, raylet, workers) must agree on these: once a first ray.init has
# written an auth token, a head started without RAY_AUTH_MODE enables token auth and rejects
# workers that were not told (`training.cluster.launch.ray_env` keeps a value the user set).
RAY_ENV_KEYS = ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")
ENV_METRIC = "env/tmax_bash/step_count"
# Ray threads per rollout worker beyond its episode slots, so prewarm calls are not
# queued behind running episodes.
PREWARM_CALL_SLOTS = 2


class ActorSampler:
    """`agents.policy.TokenSampler` that samples through an EngineActor (picklable)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None):
        import ray

        from agents.policy import ModelError

        try:
            return ray.get(self.engine.sample.remote(list(prompt_ids), max_tokens, temperature, top_p, seed))
        except ray.exceptions.RayActorError as e:
            raise ModelError(f"the engine actor is gone: {e}") from e


class TrainingError(RuntimeError):
    """The run cannot go on (an episode keeps failing on infrastructure, a dead actor)."""


# ---- Ray cluster --------------------------------------------------------------------


def init_ray(cfg: LearnConfig) -> bool:
    """Connect to `run.ray_address` / RAY_ADDRESS, or start a private local cluster bound
    to 127.0.0.1. Returns True when this process started (and must stop) the cluster."""
    from training.cluster.launch import apply_ray_env

    apply_ray_env()  # keeps a RAY_AUTH_MODE the user set, else "disabled"
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": {k: os.environ[k] for k in RAY_ENV_KEYS}}
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single node: bind loopback
    ray.init(
        # "local": always a new private cluster; without it ray.init joins whatever cluster
        # another process on this machine last started.
        address="local",
        num_cpus=cfg.run.ray_num_cpus or os.cpu_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=runtime_env,
        log_to_driver=False,
        configure_logging=False,
    )
    return True


@functools.lru_cache(maxsize=None)
def _actor_classes():
    """Ray actor classes, defined lazily so importing this module does not import ray."""
    import ray

    from training.weights.learner_side import WeightSourceMixin

    @ray.remote
    class LearnerActor(WeightSourceMixin):
        def __init__(self, model_dir: str, lcfg: Any, resume: str | None, threads: int | None):
            import torch

            from training.learner.learner import Learner

            if threads:
                torch.set_num_threads(threads)
            self.learner = Learner.load(resume, lcfg) if resume else Learner(model_dir, lcfg)

        def train_step(self, samples: list) -> dict:
            return self.learner.train_step(samples)

        def named_weights(self) -> dict:
            return self.learner.named_weights()

        def save(self, path: str, step: int, extra: dict) -> str:
            return str(self.learner.save(path, step, extra))

        def state(self) -> dict:
            return {"step": self.learner.step, "extra": self.learner.extra}

    @ray.remote
    class EngineActor:
        """Holds the inference engine; the interface the multi-node layout scales out.

        Rollout workers sample through this actor (threaded). A weight sync pauses the
        turns being sampled rather than waiting for them (`training.inference.engine`); each turn
        is tagged with the oldest weights version that produced it."""

        def __init__(self, model_dir: str, ecfg: Any, seed: int, work_dir: str | None = None):
            from training.inference.engine import VLLMEngine

            self.engine = VLLMEngine.from_config(ecfg, model_dir, work_dir)
            self._sampler = self.engine.sampler(seed)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def info(self) -> dict:
            return {"base_url": self.engine.base_url, "model": self.engine.served_model_name,
                    "version": self.engine.policy_version, "mixed_turns": self.engine.mixed_turns}

        def sample(self, prompt_ids: list, max_tokens: int, temperature: float, top_p: float, seed: int | None):
            return self._sampler.sample(prompt_ids, max_tokens, temperature, top_p, seed)

        def push_weights(self, weights: dict, version: int) -> float:
            return self.engine.push_weights(weights, version)

        def num_workers(self) -> int:
            return self.engine.num_workers()

        def join_weight_group(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                              timeout_s: float) -> list:
            return self.engine.join_weight_group(host, port, rank_offset, world, backend, timeout_s)

        def receive_weights(self, update: Any) -> float:
            # Blocks until learner rank 0 has broadcast the update (another actor, so the
            # two sides run at the same time).
            return self.engine.receive_weights(update)

        def weight_group(self) -> dict | None:
            # None on a fresh (e.g. Ray-restarted) engine: `WeightSync` then re-forms the group.
            return self.engine.weight_group

        def close(self) -> None:
            self.engine.close()

    @ray.remote
    class RolloutWorker:
        """Runs episodes, `slots` at a time (Ray threads), each in its own fresh sandbox;
        on podman from a warm pool of containers started ahead of need."""

        def __init__(self, model_dir: str, rcfg: Any, sampler: Any, images: dict, record_root: str | None,
                     slots: int = 1):
            from transformers import AutoTokenizer

            from training.rollout import env_settings, worker_pool

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.cfg = rcfg
            self.sampler = sampler
            self.images = images  # task dir -> TaskImage, resolved before training
            self.record_root = record_root
            self.settings = env_settings(rcfg)
            self.pool = worker_pool(rcfg, slots)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def prewarm(self, task_dir: str) -> bool:
            from training.rollout import prewarm

            return prewarm(self.pool, task_dir, self.settings, self.images.get(task_dir))

        def pool_stats(self) -> dict:
            p = self.pool
            return {"warm_hits": p.warm_hits, "cold_starts": p.cold_starts} if p is not None else {}

        def run(self, req: EpisodeRequest, version: int) -> dict:
            from training.rollout import run_episode

            record = Path(self.record_root) / f"g{req.group_id}_s{req.sample_index}" if self.record_root else None
            try:
                r = run_episode(req, self.sampler, self.tokenizer, self.cfg, settings=self.settings,
                                image=self.images.get(req.task_dir), pool=self.pool, record_dir=record,
                                start_version=version)
            except InfraError as e:
                return {"infra_error": str(e), "kind": e.kind}
            return {"rollout": r}

        def close(self) -> None:
            if self.pool is not None:
                self.pool.close(in_use=True)

    return LearnerActor, EngineActor, RolloutWorker


def close_engine(engine: Any, timeout_s: float = 60.0) -> None:
    """Stop an EngineActor's vLLM server, best effort: used on every exit path, failures
    included, where the actor may already be dead (its server then dies with it)."""
    import ray

    try:
        ray.get(engine.close.remote(), timeout=timeout_s)
    except Exception:
        pass


def start_engine(cfg: LearnConfig, model_dir: str, run_dir: str | Path) -> Any:
    """An EngineActor serving `model_dir`, ready (server healthy) when this returns."""
    import ray

    _, EngineActor, _ = _actor_classes()
    cpus = float(cfg.run.ray_num_cpus or os.cpu_count() or 2)
    work = Path(run_dir).resolve() / "engine"
    work.mkdir(parents=True, exist_ok=True)
    engine = EngineActor.options(num_cpus=min(1.0, cpus / 4), max_concurrency=cfg.run.concurrency + 4).remote(
        model_dir, cfg.engine, cfg.algo.seed, str(work))
    ray.get(engine.info.remote())  # surface start-up errors here
    return engine


def learner_config(cfg: LearnConfig):
    from training.algo.dppo import LossConfig
    from training.learner.learner import LearnerConfig

    a = cfg.algo
    return LearnerConfig(
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        betas=(a.adam_beta1, a.adam_beta2),
        eps=a.adam_eps,
        weight_decay=a.weight_decay,
        max_grad_norm=a.grad_clip,
        temperature=cfg.rollout.temperature or 1.0,
        pack_length=cfg.rollout.context_budget,
        dtype="float32",
        seed=a.seed,
        strategy=cfg.run.learner_strategy,
        loss=LossConfig(loss_fn=a.loss, divergence=a.divergence, delta=a.delta, clip_low=a.clip_low,
                        clip_high=a.clip_high),
    )


# ---- prompts and groups -------------------------------------------------------------


class PromptStream:
    """Train tasks in a seeded shuffled order, epoch after epoch; its position is saved
    in checkpoints so a resumed run continues with the next prompt."""

    def __init__(self, task_dirs: list[str], seed: int, position: int = 0):
        if not task_dirs:
            raise TrainingError("no training tasks")
        self.tasks = sorted(task_dirs)
        self.seed = seed
        self.position = position

    def next(self) -> str:
        epoch, i = divmod(self.position, len(self.tasks))
        order = list(self.tasks)
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        self.position += 1
        return order[i]


@dataclass
class OpenGroup:
    group_id: int
    task_dir: str
    size: int
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.rollouts) == self.size


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    n = max(1, len(rollouts))
    lengths = [len(r.ids) for r in rollouts] or [0]
    return {
        ENV_METRIC: sum(r.steps for r in rollouts) / n,
        "tools/bash/avg_calls_per_rollout": sum(sum(1 for _ in r.turn_versions) for r in rollouts) / n,
        "val/sequence_lengths": sum(lengths) / n,
        "val/sequence_lengths_min": float(min(lengths)),
        "val/sequence_lengths_max": float(max(lengths)),
        "val/stop_rate": sum(1 for r in rollouts if not r.truncated) / n,
        "val/truncated_completion_fraction": sum(1 for r in rollouts if r.truncated) / n,
        "val/non_submitting_completion_fraction": sum(1 for r in rollouts if not r.submitted) / n,
        "objective/verifiable_reward": sum(r.reward for r in rollouts) / n,
        "objective/verifiable_correct_rate": sum(1 for r in rollouts if r.reward >= 1.0) / n,
        "time/episode_mean_s": sum(r.timings.get("total_s", 0.0) for r in rollouts) / n,
        "time/sandbox_start_mean_s": sum(r.timings.get("sandbox_start_s", 0.0) for r in rollouts) / n,
        "env/warm_start_frac": sum(1 for r in rollouts if r.warm_start) / n,
    }


# ---- the loop -----------------------------------------------------------------------


@dataclass
class RunResult:
    run_dir: str
    steps: int
    final_checkpoint: str | None
    metrics_path: str
    rollouts_path: str
    curve_png: str | None
    summary: dict[str, Any]


def list_task_dirs(root: str | Path) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        raise TrainingError(f"task directory not found: {root}")
    dirs = sorted(str(p) for p in root.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise TrainingError(f"no Harbor tasks (dirs with task.toml) under {root}")
    return dirs


def train(
    cfg: LearnConfig,
    model_dir: str,
    train_tasks: str,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    engine_handle: Any = None,
    keep_engine: bool = False,
    on_step: Any = None,
    placement: Any = None,
    rated: Any = None,
    prepared: Any = None,
) -> RunResult:
    """Run DPPO from `model_dir` (or, with `resume`, from the run's latest checkpoint).

    `engine_handle` reuses a running EngineActor (already serving `model_dir`);
    `keep_engine` leaves it running afterwards (the recipe evaluates on it).
    `placement` (a `training.cluster.placement.Placement`) spreads learner ranks, engines and
    rollout workers over the cluster per its plan (`training.cluster.actors`). `prepared`
    (`training.rollout.PreparedTasks`) skips resolving the task environments again.
    `rated` (a `training.runs_data.RatedStream`) adds rated `tmax run` sessions to each step."""
    import ray

    from training.learner import checkpoint as ckpt
    from training.algo.batching import BatchAccumulator, BatchConfig, Group
    from training.report import MetricsSink, Progress, reward_curve, run_summary, summary

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    a, rc = cfg.algo, cfg.run
    # Every task's image is resolved (built) here, before the first step: the loop never builds.
    if prepared is None:
        prepared = prepare_tasks(cfg.rollout, list_task_dirs(train_tasks), run_dir / "train_tasks.json",
                                 progress=progress)
    tasks = prepared.runnable

    start_step, stream_pos, resume_from = 0, 0, None
    if resume:
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is None:
            raise TrainingError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
        state = ckpt.load_trainer_state(latest)
        start_step = int(state["step"])
        stream_pos = int(state["extra"].get("prompt_position", 0))
        resume_from = str(latest)
        model_dir = resume_from  # the engine serves the checkpoint's weights
    if start_step >= a.steps:
        raise TrainingError(f"nothing to do: the run is at step {start_step} of {a.steps}")

    started_ray = init_ray(cfg)
    LearnerActor, EngineActor, RolloutWorker = _actor_classes()
    cpus = float(rc.ray_num_cpus or os.cpu_count() or 2)
    t_setup = time.monotonic()
    own_engine = engine_handle is None
    if placement is not None:
        learner, engine, workers = _placed_actors(cfg, placement, model_dir, resume_from, run_dir, engine_handle,
                                                  prepared.images)
    else:
        learner = LearnerActor.options(num_cpus=min(1.0, cpus / 4)).remote(
            model_dir, learner_config(cfg), resume_from, rc.torch_threads)
        engine = engine_handle or start_engine(cfg, model_dir, run_dir)
        sampler = ActorSampler(engine)
        workers = [
            RolloutWorker.options(num_cpus=min(0.5, cpus / (4 * rc.rollout_workers)),
                                  max_concurrency=rc.slots_per_worker + PREWARM_CALL_SLOTS)
            .remote(model_dir, cfg.rollout, sampler, prepared.images, None, rc.slots_per_worker)
            for i in range(rc.rollout_workers)
        ]
    sync = WeightSync(cfg, learner, engine)
    # Initial sync: the engine serves exactly the learner's weights, tagged with its step
    # (a resumed run's engine would otherwise report version 0 and all its data look stale).
    sync.push(start_step)
    setup_s = time.monotonic() - t_setup

    acc = BatchAccumulator(BatchConfig(groups_per_batch=a.prompts_per_step, filter_zero_std=a.filter_zero_std,
                                       active_sampling=a.active_sampling, max_staleness=a.async_steps))
    stream = PromptStream(tasks, a.seed, stream_pos)
    sink = MetricsSink(run_dir, wandb=rc.wandb, tensorboard=rc.tensorboard, project=rc.wandb_project,
                       run_name=run_dir.name, config=cfg.model_dump())
    rollouts_path = run_dir / "rollouts.jsonl"

    groups: dict[int, OpenGroup] = {}
    queue: deque[EpisodeRequest] = deque()
    pending: dict[Any, tuple[EpisodeRequest, int]] = {}
    ready: deque[Group] = deque()
    next_group = start_step * 100_000  # group ids stay unique across resumes
    since_step: list[Rollout] = []
    counters = {"episodes": 0, "requeued": 0}
    infra = InfraCounts()
    prewarmed: set[tuple] = set()

    def open_prompt() -> None:
        nonlocal next_group
        task_dir = stream.next()
        gid = next_group
        next_group += 1
        groups[gid] = OpenGroup(gid, task_dir, a.group_size)
        for i in range(a.group_size):
            # Per-sample seed = base + sample index (as the recipe seeds vLLM), offset per group so
            # groups do not replay each other.
            queue.append(EpisodeRequest(task_dir, gid, i, a.seed + gid * a.group_size + i))

    for _ in range(a.prompts_per_step * max(1, a.async_steps)):
        open_prompt()

    version = start_step
    step = start_step
    train_ref = None
    train_started = 0.0
    batch = None
    wait_started = time.monotonic()
    t_run = time.monotonic()
    worker_i = 0
    useless = 0
    max_useless = max(200, 25 * a.prompts_per_step)
    bar = Progress(a.steps, start_step, enabled=progress)

    # Throughput bookkeeping: time with at least one episode in flight (sampler busy), and
    # the wall time of each step from the end of the previous one.
    busy_s, last_tick, step_wall_start = 0.0, time.monotonic(), time.monotonic()
    try:
        while step < a.steps:
            now = time.monotonic()
            if pending:
                busy_s += now - last_tick
            last_tick = now
            # Dispatch while there is room; with no async budget, only between steps.
            while queue and len(pending) < rc.concurrency and (train_ref is None or a.async_steps > 0):
                req = queue.popleft()
                w = workers[worker_i % len(workers)]
                worker_i += 1
                pending[w.run.remote(req, version)] = (req, version)
            if cfg.rollout.pool_size and cfg.rollout.sandbox == "podman":
                prewarm_queue(queue, workers, worker_i, cfg.rollout.pool_size, prewarmed)
            wait_on = list(pending) + ([train_ref] if train_ref is not None else [])
            done, _ = ray.wait(wait_on, num_returns=1, timeout=1.0)
            for ref in done:
                if ref is train_ref:
                    continue
                req, _v = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayError as e:  # a dead worker: infrastructure
                    out = {"infra_error": f"rollout worker failed: {e}", "kind": "worker"}
                if "infra_error" in out:
                    counters["requeued"] += 1
                    infra.add(out["kind"], req.task_dir, out["infra_error"])
                    if req.attempt >= cfg.rollout.max_infra_retries:
                        raise TrainingError(
                            f"episode {req.key} of {req.task_dir} failed {req.attempt + 1} times on "
                            f"infrastructure: {out['infra_error']}")
                    req.attempt += 1
                    queue.appendleft(req)  # dropped and re-queued, never scored
                    continue
                r: Rollout = out["rollout"]
                counters["episodes"] += 1
                since_step.append(r)
                append_jsonl(rollouts_path, r.to_json())
                g = groups[req.group_id]
                g.rollouts.append(r)
                if g.done:
                    del groups[req.group_id]
                    rs = sorted(g.rollouts, key=lambda x: x.sample_index)
                    ready.append(Group(r.task_id, [x.reward for x in rs], rs, min(x.policy_version for x in rs)))
            # Offer finished groups to the batch of the next step to train.
            consume_step = step + (1 if train_ref is not None else 0)
            while ready and not acc.full:
                fate = acc.offer(ready.popleft(), consume_step)
                open_prompt()  # one new prompt per consumed group
                useless = useless + 1 if fate == "filtered" else 0
                if useless and useless % 50 == 0:
                    bar.note(f"{useless} groups in a row without reward variance (all solved or all failed)")
                if useless >= max_useless:
                    raise TrainingError(
                        f"{useless} groups in a row had no reward variance: the policy never solves (or always "
                        "solves) these tasks, so there is nothing to learn from. Warm-start with SFT, or use "
                        "tasks of matching difficulty.")
            if train_ref is None and acc.full:
                batch = acc.take(step)
                samples = batch_samples(batch.groups, batch.advantages)
                if rated is not None:
                    samples += rated.next_samples()  # single-sample groups, A = R - baseline
                if not samples:
                    bar.note(f"step {step}: every group was filtered; skipping")
                    continue
                wait_s = time.monotonic() - wait_started
                train_started = time.monotonic()
                train_ref = learner.train_step.remote(samples)
            if train_ref is not None and train_ref in done:
                try:
                    metrics = ray.get(train_ref)
                except ray.exceptions.RayActorError as e:
                    last = ckpt.latest_checkpoint(run_dir)
                    where = f"resume from {last} with --resume" if last else "no checkpoint was written yet"
                    raise TrainingError(f"the learner died during step {step + 1}: {e}; {where}") from e
                train_s = time.monotonic() - train_started
                train_ref = None
                t_sync = time.monotonic()
                sync_s = sync.push(step + 1)
                version = step + 1
                step += 1
                batch_rollouts = [x for g in batch.groups for x in g.items]
                metrics.update(batch.metrics)
                metrics.update(rollout_metrics(batch_rollouts))
                metrics.update({
                    "train/reward_all_rollouts": sum(x.reward for x in since_step) / max(1, len(since_step)),
                    "time/getting_response": wait_s,
                    "time/step_total": time.monotonic() - train_started + wait_s,
                    "time/weight_sync": sync_s,
                    "time/weight_sync_call": time.monotonic() - t_sync,
                    "time/total": time.monotonic() - t_run,
                    "episode": float(counters["episodes"]),
                    "infra/requeued": float(counters["requeued"]),
                    **infra.metrics(),
                    "training_step": float(step),
                })
                step_wall = max(1e-9, time.monotonic() - step_wall_start)
                metrics.update({
                    "perf/sampler_busy_frac": min(1.0, busy_s / step_wall),
                    "perf/learner_busy_frac": min(1.0, train_s / step_wall),
                    "perf/sampled_tokens_per_s": sum(x.num_sampled for x in since_step) / step_wall,
                    "perf/env_steps_per_s": sum(x.steps for x in since_step) / step_wall,
                    "time/training": train_s,
                })
                busy_s, step_wall_start = 0.0, time.monotonic()
                since_step = []
                if step % rc.checkpoint_every == 0 or step == a.steps:
                    t_save = time.monotonic()
                    ray.get(learner.save.remote(str(ckpt.checkpoint_path(run_dir, step)), step,
                                                {"prompt_position": stream.position - len(groups) - len(ready),
                                                 "config": cfg.name}))
                    ckpt.prune_checkpoints(run_dir, rc.keep_checkpoints)
                    metrics["time/saving"] = time.monotonic() - t_save
                sink.log(step, metrics)
                bar.update(step, summary(metrics))
                if on_step is not None:
                    on_step(step, metrics)
                wait_started = time.monotonic()
    except KeyboardInterrupt:
        # Ctrl-C: keep what was learned. The learner holds the weights of the last finished
        # step; save them (unless that step was just saved) so --resume continues from here.
        bar.note(f"interrupted at step {step}: saving a checkpoint")
        try:
            save_step = step
            if train_ref is not None:
                # Let the update in flight finish: its weights are the newest.
                ray.get(train_ref, timeout=600)
                save_step = step + 1
            if save_step > start_step and not ckpt.checkpoint_path(run_dir, save_step).exists():
                ray.get(learner.save.remote(str(ckpt.checkpoint_path(run_dir, save_step)), save_step,
                                            {"prompt_position": stream.position - len(groups) - len(ready),
                                             "config": cfg.name}), timeout=300)
                bar.note(f"saved {ckpt.checkpoint_path(run_dir, save_step)}; continue with --resume")
        except Exception as e:  # the interrupt is the user's: report, do not mask it
            bar.note(f"could not save the interrupted run: {e}")
        raise
    finally:
        bar.close()
        sink.close()
        for ref in list(pending):
            ray.cancel(ref, force=False)
        _close_workers(workers)
        if own_engine and not keep_engine:
            close_engine(engine)
            _kill(engine)
        _kill(learner)
        if started_ray and not keep_engine:
            ray.shutdown()

    final = ckpt.latest_checkpoint(run_dir)
    png = reward_curve(run_dir / "metrics.jsonl", run_dir / "reward_curve.png")
    summ = run_summary(run_dir / "metrics.jsonl", setup_s, time.monotonic() - t_run)
    summ.update({"tasks_runnable": len(tasks), "tasks_dropped": len(prepared.dropped),
                 "env/infra_errors": infra.total, "infra_errors_by_kind": dict(infra.by_kind)})
    (run_dir / "summary.json").write_text(json.dumps(summ, indent=2))
    return RunResult(str(run_dir), step, str(final) if final else None, str(run_dir / "metrics.jsonl"),
                     str(rollouts_path), png, summ)


def _placed_actors(cfg: LearnConfig, placement: Any, model_dir: str, resume_from: str | None,
                   run_dir: Path, engine_handle: Any, images: dict) -> tuple[Any, Any, list]:
    """Learner ranks, engines and rollout workers spread over the cluster per the plan."""
    from training.cluster.actors import start_placed

    if engine_handle is not None:
        raise TrainingError("a placed run starts its own engines; engine_handle cannot be reused with a placement")
    return start_placed(cfg, placement, model_dir, resume_from, run_dir, _actor_classes(), learner_config(cfg),
                        images)


def _close_workers(workers: list) -> None:
    """Close the workers' warm pools (their idle containers), then kill the actors."""
    import ray

    refs = []
    for w in workers:
        try:
            refs.append(w.close.remote())
        except Exception:
            pass
    try:
        ray.wait(refs, num_returns=len(refs), timeout=120)
    except Exception:
        pass
    for w in workers:
        try:
            ray.kill(w)
        except Exception:
            pass


def _kill(actor: Any) -> None:
    """Kill an actor, or every actor of a placed group (`training.cluster.actors`)."""
    import ray

    if isinstance(actor, ray.actor.ActorHandle):
        ray.kill(actor)
    else:
        actor.kill()
