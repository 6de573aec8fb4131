"""`tmax learn` on Ray: the DPPO loop (`Trainer`) over learner, engine and rollout-worker actors.

One program for every placement: the actors (`training.cluster.actors`) are a group of learner
ranks, a group of engines and rollout workers, one of each kind on a single machine, spread per
a `training.cluster.placement` plan on a cluster. The driver (the `Trainer`) owns no heavy
state: it hands episode requests to rollout workers, gathers finished groups, lets the batching
accumulator decide what trains, and tells the learner to step and the engines to load weights.

    prompts -> G episode requests per prompt -> rollout workers (the `Generator`'s
    `EpisodeWorker.generate`: a scored, token-exact episode) -> finished group -> BatchAccumulator (staleness,
    zero-std filter, active sampling) -> centered advantages (a branching group's: per stretch of
    turns, `training.algo.tree`; written to advantages.jsonl) -> LearnerGroup.train_step
    (one optimizer step) -> WeightSync.push (no restart) -> checkpoint every N.

Asynchrony: generation keeps running while the learner trains, bounded two ways: the
number of open prompts is fixed (each consumed group enqueues one new prompt), and data
whose oldest turn is more than `async_steps` versions behind the consuming step is
dropped by the accumulator. With `async_steps = 0` dispatch pauses during training.

The loop sees episodes only through `training.generator` (import-linter keeps it off
`tmax.sandbox` and `training.rollout`): Harbor tasks in sandboxes and text prompts are two
generators of the same loop. Ray is the caller's (`training.cluster.run_cluster.ray_session`).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tmax.common.files import append_line_atomic, write_text_atomic
from tmax.common.records import CheckpointExtra, LearnRunDir, RunSummary, write_record
from tmax.training.agentic import agentic_metrics, of_rollout
from tmax.training.branch_records import advantage_records, branch_metrics
from tmax.training.algo.batching import BatchAccumulator, BatchConfig, Group
from tmax.training.cluster.actors import Actors, EngineGroup, start_actors
from tmax.training.config import LearnConfig, dump_toml
from tmax.training.generator import GeneratedEpisode, EpisodeRequest, Generator, InfraCounts, Rollout
from tmax.training.learner import checkpoint as ckpt
from tmax.training.learner.lora import run_start
from tmax.training.learner.packing import batch_samples
from tmax.training.liveness import group_member_died
from tmax.training.report import (LearnProgress, MetricsSink, StepClock, StepFigures, StepLines, reward_curve,
                                  rollout_metrics, run_summary, throughput_metrics)
from tmax.training.rollback import RunGuard
from tmax.training.weights.learner_side import WeightSync

if TYPE_CHECKING:
    from tmax.training.cluster.reservation import Placement
    from tmax.training.runs_data import RatedBatch, RatedStream

StepHook = Callable[[int, dict[str, float]], None]  # called with each step's metrics once they are logged


class TrainingError(RuntimeError):
    """The run cannot go on (an episode keeps failing on infrastructure, a dead actor)."""


def learner_config(cfg: LearnConfig):
    """The learner's `LearnerConfig` from the run's algo / rollout / run / lora sections."""
    from tmax.training.algo.dppo import LossConfig
    from tmax.training.learner.learner import LearnerConfig
    from tmax.training.learner.lora import LoraSpec, learner_dtype

    a = cfg.algo
    return LearnerConfig(
        lr=a.lr, warmup_steps=a.warmup_steps, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps,
        weight_decay=a.weight_decay, max_grad_norm=a.grad_clip, temperature=cfg.rollout.temperature or 1.0,
        pack_length=cfg.run.learner_pack_tokens or cfg.rollout.context_budget, seed=a.seed, strategy=cfg.run.learner_strategy,
        dtype=learner_dtype(cfg.lora, cfg.engine.dtype), gradient_checkpointing=cfg.run.gradient_checkpointing,
        loss=LossConfig(loss_fn=a.loss, divergence=a.divergence, delta=a.delta, clip_low=a.clip_low,
                        clip_high=a.clip_high), lora=LoraSpec.of(cfg.lora))


class PromptStream:
    """Train tasks in a seeded shuffled order, epoch after epoch; its position is saved
    in checkpoints so a resumed run continues with the next prompt."""

    def __init__(self, prompts: list[str], seed: int, position: int = 0):
        if not prompts:
            raise TrainingError("no training tasks")
        self.tasks = sorted(prompts)
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
    size: int  # episodes requested (a branching one comes back as several leaves)
    rollouts: list[Rollout] = field(default_factory=list)
    returned: int = 0  # requests that came back scored

    @property
    def done(self) -> bool:
        return self.returned == self.size

    def group(self, branching: bool) -> Group:
        """The finished group for the batch: its leaves in path order, with their tree paths
        when the episodes branched (`training.algo.tree`)."""
        rs = sorted(self.rollouts, key=lambda x: (x.sample_index, x.branch_path))
        paths = [(x.sample_index, *x.branch_path) for x in rs] if branching else None
        return Group(rs[0].task_id, [x.reward for x in rs], rs, min(x.policy_version for x in rs), paths)


@dataclass
class RunResult:
    run_dir: str
    steps: int
    final_checkpoint: str | None
    metrics_path: str
    rollouts_path: str
    curve_png: str | None
    summary: RunSummary


@dataclass
class LoopState:
    """Everything the loop changes while it runs (config and actors stay fixed)."""

    step: int  # optimizer steps done
    version: int  # the weights version the engines serve
    next_group: int  # id of the next prompt's group
    clock: StepClock = field(default_factory=StepClock.now)
    groups: dict[int, OpenGroup] = field(default_factory=dict)  # prompts with episodes to finish
    queue: deque[EpisodeRequest] = field(default_factory=deque)  # episodes to dispatch
    pending: dict[Any, EpisodeRequest] = field(default_factory=dict)  # episode ref -> its request
    ready: deque[Group] = field(default_factory=deque)  # finished groups not yet offered
    since_step: list[Rollout] = field(default_factory=list)  # episodes finished since the last step
    episodes: int = 0
    requeued: int = 0
    infra: InfraCounts = field(default_factory=InfraCounts)
    next_worker: int = 0  # round-robin dispatch position
    worker_of: dict[Any, tuple] = field(default_factory=dict)  # episode ref -> (worker index, sent at)
    useless: int = 0  # groups in a row without reward variance
    train_ref: Any = None  # the learner's step in flight
    batch: Any = None  # the `Batch` it trains on
    rated_batch: RatedBatch | None = None  # the rated sessions it also trains on


class Trainer:
    """The DPPO loop over `actors` (see the module docstring): `run()` trains from
    `start_step` to `algo.steps`; `close()` ends logging and cancels episodes in flight."""

    def __init__(self, cfg: LearnConfig, run_dir: Path, actors: Actors, sync: WeightSync, stream: PromptStream,
                 start_step: int, generator: Generator, *, progress: LearnProgress | None = None,
                 on_step: StepHook | None = None, rated: RatedStream | None = None):
        a, rc = cfg.algo, cfg.run
        self.cfg, self.run_dir, self.actors, self.sync, self.stream = cfg, run_dir, actors, sync, stream
        self.generator = generator
        self.start_step, self.on_step, self.rated = start_step, on_step, rated
        self.acc = BatchAccumulator(BatchConfig(groups_per_batch=a.prompts_per_step, filter_zero_std=a.filter_zero_std,
                                                active_sampling=a.active_sampling, max_staleness=a.async_steps))
        self.sink = MetricsSink(run_dir, wandb=rc.wandb, tensorboard=rc.tensorboard, project=rc.wandb_project,
                                run_name=run_dir.name, config=cfg.model_dump())
        self.bar = progress or StepLines()
        self.bar.begin(a.steps, start_step)
        self.files = LearnRunDir(run_dir)
        self.rollouts_path = self.files.rollouts
        self.max_useless = max(200, 25 * a.prompts_per_step)
        # Group ids stay unique across resumes.
        self.state = LoopState(step=start_step, version=start_step, next_group=start_step * 100_000)
        self.ahead = generator.warm_ahead(actors.workers)  # told the episodes next in line
        for _ in range(a.prompts_per_step * max(1, a.async_steps)):
            self.open_prompt()
        self.guard = RunGuard(self)  # collapse guard: health signals, rollbacks (training/rollback.py)

    def run(self) -> None:
        s = self.state
        self.guard.begin(self)
        try:
            while s.step < self.cfg.algo.steps and not self.guard.stopped:
                self.dispatch()
                done = self.wait()
                self.collect(done)
                self.offer_groups()
                if s.train_ref is None and self.acc.full:
                    self.start_train_step()
                if s.train_ref is not None and s.train_ref in done:
                    self.finish_train_step()
        except KeyboardInterrupt:
            self.save_on_interrupt()
            raise
        except Exception as e:
            from tmax.training.learner.checkpoint import full_disk_report, is_disk_full

            died = group_member_died(e, self.actors.learner.ranks)  # training, syncing or saving
            if died is not None:  # the step stops; with N ranks, the survivors' collectives fail too
                raise self.learner_died(died) from e
            if not is_disk_full(e):
                raise
            raise TrainingError(f"the run stopped at step {s.step}: {full_disk_report(self.run_dir, e)}") from e

    def learner_died(self, e: Exception) -> TrainingError:
        last = ckpt.latest_checkpoint(self.run_dir)
        where = f"resume from {last} with --resume" if last else "no checkpoint was written yet"
        return TrainingError(f"the learner died during step {self.state.step + 1}: {e}; {where}")

    def open_prompt(self) -> None:
        s, a = self.state, self.cfg.algo
        task_dir, gid = self.stream.next(), s.next_group
        s.next_group += 1
        s.groups[gid] = OpenGroup(gid, task_dir, a.group_size)
        for i in range(a.group_size):
            # Per-sample seed = base + sample index (as the recipe seeds vLLM), offset per group so
            # groups do not replay each other.
            s.queue.append(EpisodeRequest(task_dir, gid, i, a.seed + gid * a.group_size + i))

    def dispatch(self) -> None:
        """Queued episodes to the workers, round-robin, while there is room; with no async
        budget, only between steps."""
        s, workers = self.state, self.actors.workers
        can_overlap = s.train_ref is None or self.cfg.algo.async_steps > 0
        while s.queue and len(s.pending) < self.cfg.run.concurrency and can_overlap:
            w = self.actors.workers_down.next_live(s.next_worker, len(self.actors.workers))
            if w is None:
                break  # every worker is restarting
            req, s.next_worker = s.queue.popleft(), w + 1
            ref = workers[w].generate.remote(req, s.version)
            s.pending[ref], s.worker_of[ref] = req, (w, time.monotonic())
        self.ahead.fill((req, (s.next_worker + j) % len(workers)) for j, req in enumerate(s.queue))

    def wait(self) -> list:
        """Up to one second for an episode or the train step to finish; the refs that did."""
        import ray

        s, c = self.state, self.state.clock
        c.tick(bool(s.pending), time.monotonic())
        wait_on = list(s.pending) + ([s.train_ref] if s.train_ref is not None else [])
        if not wait_on and s.queue:  # every worker is restarting: wait for their next try
            time.sleep(0.5)
            return []
        if not wait_on and not (s.ready or self.acc.full):  # nothing can finish, nothing can start
            raise TrainingError(f"step {s.step + 1}: no episode in flight, none queued and no batch to train "
                                f"({len(s.groups)} open groups, {len(s.ready)} ready)")
        return ray.wait(wait_on, num_returns=1, timeout=1.0)[0] if wait_on else []

    def collect(self, done: list) -> None:
        """Finished episodes into their groups; an infrastructure failure is re-queued."""
        import ray

        s = self.state
        for ref in done:
            req, (worker, sent) = s.pending.pop(ref, None), s.worker_of.pop(ref, (None, 0.0))
            if req is None:
                continue  # the train step
            try:
                out: GeneratedEpisode = ray.get(ref)
                self.actors.workers_down.up(worker)
            except ray.exceptions.RayError as e:  # a dead worker: infrastructure; Ray restarts it
                out = GeneratedEpisode(infra_error=f"rollout worker failed: {e}", infra_kind="worker",
                                     ran=self.actors.worker_failed(worker, sent))
            if out.rollout is None:
                self.requeue(req, out.infra_kind, out.infra_error, attempt=out.ran)
            else:
                for failure in out.branch_failures:  # lost branches: counted, never scored
                    s.infra.add(f"branch_{failure.kind}", req.task_dir, failure.error)
                self.add_rollouts(req, out.leaves)

    def requeue(self, req: EpisodeRequest, kind: str, error: str, attempt: bool = True) -> None:
        """Dropped and re-queued at the front, never scored; too many attempts end the run.
        An episode a restarting worker refused never ran: re-queued, not counted."""
        s = self.state
        if attempt:
            s.requeued += 1
            s.infra.add(kind, req.task_dir, error)
            if req.attempt >= self.cfg.rollout.max_infra_retries:
                raise TrainingError(f"episode {req.key} of {req.task_dir} failed {req.attempt + 1} times on "
                                    f"infrastructure: {error}")
            req.attempt += 1
        s.queue.appendleft(req)

    def add_rollouts(self, req: EpisodeRequest, leaves: list[Rollout]) -> None:
        """A returned episode (a branching one's leaves) into its group; a finished group is ready."""
        s = self.state
        g = s.groups[req.group_id]
        for r in leaves:
            s.episodes += 1
            s.since_step.append(r)
            append_line_atomic(self.rollouts_path, r.to_json())
            g.rollouts.append(r)
        g.returned += 1
        if g.done:
            del s.groups[req.group_id]
            s.ready.append(g.group(self.cfg.rollout.branching.enabled))

    def offer_groups(self) -> None:
        """Finished groups to the batch of the next step to train, one new prompt each."""
        s = self.state
        consume_step = s.step + (1 if s.train_ref is not None else 0)
        while s.ready and not self.acc.full:
            fate = self.acc.offer(s.ready.popleft(), consume_step)
            self.open_prompt()
            s.useless = s.useless + 1 if fate == "filtered" else 0
            if self.guard.on_stall(self):
                return
            if s.useless and s.useless % 50 == 0:
                self.bar.note(f"{s.useless} groups in a row without reward variance (all solved or all failed)")
            if s.useless >= self.max_useless:
                raise TrainingError(
                    f"{s.useless} groups in a row had no reward variance: the policy never solves (or always "
                    "solves) these tasks, so there is nothing to learn from. Warm-start with SFT, or use "
                    "tasks of matching difficulty.")

    def start_train_step(self) -> None:
        """Take the full batch and start the learner on it (unless nothing in it trains)."""
        s, c = self.state, self.state.clock
        s.batch = self.acc.take(s.step)
        samples = batch_samples(s.batch.groups, s.batch.segment_advantages)
        if s.batch.groups:
            append_line_atomic(self.files.advantages, "\n".join(advantage_records(s.batch)))
        if self.rated is not None:
            s.rated_batch = self.rated.next_batch()  # single-sample groups, A = R - baseline
            samples += s.rated_batch.samples
        if not samples:
            self.bar.note(f"step {s.step}: every group was filtered; skipping")
            return
        c.train_started = time.monotonic()
        c.wait_s = c.train_started - c.wait_started
        s.train_ref = self.actors.learner.train_step(samples)

    def finish_train_step(self) -> None:
        """The step's metrics; then the new weights to the engines, metrics logged, and a
        checkpoint every `checkpoint_every` steps and at the last."""
        import ray

        s, c, a = self.state, self.state.clock, self.cfg.algo
        metrics = ray.get(s.train_ref)  # a dead learner: see run()
        train_s = time.monotonic() - c.train_started
        c.tick(bool(s.pending), time.monotonic())
        s.train_ref = None
        t_sync = time.monotonic()
        sync_s = self.sync.push(s.step + 1)
        s.version = s.step = s.step + 1
        metrics.update(self.step_metrics(train_s, sync_s, time.monotonic() - t_sync))
        c.new_step(time.monotonic())
        step, rolled_back = s.step, self.guard.after_step(self, metrics)  # may go back to a healthy step
        s.since_step = []
        if not rolled_back and (s.step % self.cfg.run.checkpoint_every == 0 or s.step == a.steps):
            t_save = time.monotonic()
            self.save(s.step)
            ckpt.prune_checkpoints(self.run_dir, self.cfg.run.keep_checkpoints)
            metrics["time/saving"] = time.monotonic() - t_save
        self.sink.log(step, metrics)
        self.bar.update(StepFigures.of(s.step, metrics))
        if self.on_step is not None:
            self.on_step(step, metrics)
        c.wait_started = time.monotonic()

    def step_metrics(self, train_s: float, sync_s: float, sync_call_s: float) -> dict[str, float]:
        """Batch, rollout, time and throughput metrics of the step just finished."""
        s, c = self.state, self.state.clock
        now = time.monotonic()
        since = s.since_step
        step_wall = max(1e-9, now - c.step_wall_start)
        return {
            **s.batch.metrics,
            **rollout_metrics([x for g in s.batch.groups for x in g.items]),
            **branch_metrics(s.batch, since),
            **agentic_metrics([of_rollout(x) for x in since]),  # every episode finished, filtered groups too
            **(s.rated_batch.metrics if s.rated_batch is not None else {}),
            "train/reward_all_rollouts": sum(x.reward for x in since) / max(1, len(since)),
            "time/getting_response": c.wait_s,
            "time/step_total": now - c.train_started + c.wait_s,
            "time/weight_sync": sync_s,
            "time/weight_sync_call": sync_call_s,
            "weights/sync_bytes": float(self.sync.payload.nbytes),  # per engine: an adapter's, or every weight
            "time/total": now - c.run_start,
            "episode": float(s.episodes),
            "infra/requeued": float(s.requeued),
            **s.infra.metrics(),
            "training_step": float(s.step),
            "perf/sampler_busy_frac": c.sampler_busy_frac(now),
            "perf/learner_busy_frac": min(1.0, train_s / step_wall),
            **throughput_metrics(since, step_wall),
            "time/training": train_s,
        }

    def save(self, step: int, timeout_s: float | None = None) -> Path:
        """The learner's weights and optimizer as the checkpoint of `step`, with the prompt
        and rated-session positions a resumed run continues from."""
        import ray

        s = self.state
        path = ckpt.checkpoint_path(self.run_dir, step)
        extra = CheckpointExtra(prompt_position=self.stream.position - len(s.groups) - len(s.ready),
                                config=self.cfg.name, guard=self.guard.state(),
                                rated_position=self.rated.position if self.rated is not None else None)
        ray.get(self.actors.learner.save(str(path), step, extra), timeout=timeout_s)
        return path

    def save_on_interrupt(self) -> None:
        """Ctrl-C: keep what was learned. The learner holds the weights of the last finished
        step (or of the update in flight, once it finishes); save them unless that step was
        just saved, so --resume continues from here."""
        import ray

        s = self.state
        self.bar.note(f"interrupted at step {s.step}: saving a checkpoint")
        try:
            save_step = s.step
            if s.train_ref is not None:
                ray.get(s.train_ref, timeout=600)  # its weights are the newest
                save_step = s.step + 1
            if save_step > self.start_step and not ckpt.checkpoint_path(self.run_dir, save_step).exists():
                self.bar.note(f"saved {self.save(save_step, timeout_s=300)}; continue with --resume")
        except Exception as e:  # the interrupt is the user's: report, do not mask it
            self.bar.note(f"could not save the interrupted run: {e}")

    def close(self) -> None:
        import ray

        self.bar.close()
        self.sink.close()
        for ref in list(self.state.pending):
            ray.cancel(ref, force=False)

    def result(self, setup_s: float) -> RunResult:
        """Reward curve and summary.json of the finished run."""
        final = ckpt.latest_checkpoint(self.run_dir)
        metrics = self.files.metrics
        png = reward_curve(metrics, self.files.reward_curve)
        summ = run_summary(metrics, setup_s, time.monotonic() - self.state.clock.run_start)
        infra = self.state.infra
        summ = summ.model_copy(update={**self.generator.task_counts().model_dump(), "infra_errors": infra.total,
                                       "infra_errors_by_kind": dict(infra.by_kind)})
        write_record(self.files.summary, summ)
        return RunResult(str(self.run_dir), self.state.step, str(final) if final else None, str(metrics),
                         str(self.rollouts_path), png, summ)


def train(
    cfg: LearnConfig,
    model_dir: str,
    generator: Generator,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: LearnProgress | None = None,
    engine_handle: EngineGroup | None = None,
    keep_engine: bool = False,
    on_step: StepHook | None = None,
    placement: Placement | None = None,
    rated: RatedStream | None = None,
) -> RunResult:
    """Run DPPO from `model_dir` (or, with `resume`, from the run's latest checkpoint) on
    `generator`'s episodes (`training.generator`, its tasks prepared), on the Ray this process
    is connected to (`training.entry` connects it, per `cfg.cluster`, and checked that a fresh
    run does not write over another: `checkpoint.refuse_fresh_run_over`).

    `engine_handle` reuses running engines (an `EngineGroup` serving `model_dir`); `keep_engine`
    leaves them running (the recipe evaluates on them). `placement` (`training.cluster.placement`)
    spreads the actors over the cluster per its plan. `rated` (`training.runs_data.RatedStream`)
    adds rated `tmax run` sessions to each step."""
    run_dir = Path(run_dir)
    write_text_atomic(run_dir / "config.toml", dump_toml(cfg))
    start_step, positions, resume_from = ckpt.resume_point(run_dir) if resume else (0, CheckpointExtra(), None)
    # The engines serve the checkpoint's weights; with LoRA, an adapter (a new one for a full model).
    model_dir = run_start(cfg.lora, resume_from or model_dir, run_dir, cfg.algo.seed)
    if start_step >= cfg.algo.steps:
        raise TrainingError(f"nothing to do: the run is at step {start_step} of {cfg.algo.steps}")
    stream = PromptStream(generator.prompts, cfg.algo.seed, positions.prompt_position)
    if rated is not None:
        rated.position = positions.rated_position if positions.rated_position is not None else rated.position

    t_setup = time.monotonic()
    actors: Actors | None = None
    trainer: Trainer | None = None
    try:
        actors = start_actors(cfg, model_dir, resume_from, run_dir, learner_config(cfg), generator.worker(model_dir),
                              generator.labels, placement, engine_handle)
        sync = WeightSync(cfg, actors.learner, actors.engines)
        # Initial sync: the engines serve exactly the learner's weights, tagged with its step
        # (a resumed run's engines would otherwise report version 0 and all its data look stale).
        sync.push(start_step)
        setup_s = time.monotonic() - t_setup
        trainer = Trainer(cfg, run_dir, actors, sync, stream, start_step, generator, progress=progress,
                          on_step=on_step, rated=rated)
        trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        if actors is not None:
            actors.close(keep_engines=keep_engine)
    return trainer.result(setup_s)
