"""Harbor tasks in sandboxes: the `training.generator.Generator` of `tasks.format = "harbor"`.

Everything the trainer must not know lives here and below: each task's environment resolved
(images built) before the run (`training.rollout.prepare_tasks`), the rollout workers'
sandbox pools (`training.cluster.rollout_worker`, `EpisodeSettings.worker_pool`), the
containers started ahead for the episodes next in line (`sandbox.pool.WarmAhead`) and the
labels that find a run's leftover containers (`training.rollout.run_labels`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tmax.common.records import TaskCounts
from tmax.sandbox.pool import WarmAhead
from tmax.sandbox.pool_factory import starts_ahead
from tmax.tasks.episode import PreparedTasks
from tmax.training.cluster.rollout_worker import RolloutWorker
from tmax.training.config import LearnConfig
from tmax.training.generator import EpisodeRequest, WorkerSpec
from tmax.training.rollout import EpisodeSettings, env_settings, list_task_dirs, prepare_tasks, run_labels


class HarborGenerator:
    """Episodes of the `prepared` Harbor tasks, each in a fresh sandbox of `rollout.sandbox`,
    scored by the task's verifier (`training.rollout.run_episode`)."""

    def __init__(self, cfg: LearnConfig, prepared: PreparedTasks, run_dir: str | Path):
        self.prepared = prepared
        self.prompts = prepared.runnable
        self.labels = run_labels(run_dir) if cfg.rollout.sandbox == "podman" else None
        self.episode = EpisodeSettings.of(cfg.rollout, self.labels)

    @classmethod
    def prepare(cls, cfg: LearnConfig, train_dir: str, run_dir: str | Path, *,
                progress: Callable[[int, int], None] | None = None) -> HarborGenerator:
        """Every task under `train_dir` with its environment resolved (built) now: the loop never
        builds. What cannot run is dropped, listed in `run_dir/train_tasks.json`."""
        r = cfg.rollout
        prepared = prepare_tasks(env_settings(r.sandbox, r.image_map, overlay=r.overlay), list_task_dirs(train_dir),
                                 Path(run_dir) / "train_tasks.json", progress=progress)
        return cls(cfg, prepared, run_dir)

    def worker(self, model_dir: str) -> WorkerSpec:
        return WorkerSpec(RolloutWorker, {"model_dir": model_dir, "episode": self.episode,
                                          "images": self.prepared.images})

    def warm_ahead(self, workers: list[Any]) -> WarmAhead:
        """Each worker starts containers (podman) for the `rollout.pool_size` queued episodes it
        will receive next (dispatch is round-robin in queue order), each episode once."""
        def start(item: tuple[EpisodeRequest, int]) -> bool:
            workers[item[1]].prewarm.remote(item[0].task_dir)
            return True  # asked; a worker whose pool is full starts none, and that episode starts cold

        depth = self.episode.pool_size * len(workers) if starts_ahead(self.episode.env.kind) else 0
        return WarmAhead(depth, start, key=lambda item: (item[0].group_id, item[0].sample_index, item[0].attempt))

    def task_counts(self) -> TaskCounts:
        return TaskCounts(tasks_runnable=len(self.prepared.runnable), tasks_dropped=len(self.prepared.dropped))
