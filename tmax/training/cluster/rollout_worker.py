"""`RolloutWorker`: runs training episodes as a Ray actor.

A plain class: `training.cluster.actors.start_actors` wraps it with `ray.remote` where the
workers are created. Importing this module imports neither Ray nor torch (the tokenizer is
loaded when a worker starts)."""

from __future__ import annotations

from tmax.agents.policy import TokenSampler

from tmax.training.cluster.sandbox_nodes import NODE_LABEL, normal_priority
from tmax.training.branching import run_tree
from tmax.training.generator import GeneratedEpisode, EpisodeRequest
from tmax.training.net import ray_node_id
from tmax.training.rollout import EpisodeSettings, InfraError, prewarm, run_episode


class RolloutWorker:
    """Runs episodes, `slots` at a time (Ray threads), each in its own fresh sandbox; on
    podman an overlay of a container shared on its node (`EpisodeSettings.worker_pool`)."""

    def __init__(self, model_dir: str, episode: EpisodeSettings, sampler: TokenSampler, images: dict, slots: int = 1):
        from transformers import AutoTokenizer

        normal_priority()  # its episodes' commands run as a bench trial's do, not at Ray's niceness 15
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.episode = episode
        self.sampler = sampler
        self.images = images  # task dir -> TaskImage, resolved before training
        self.pool = episode.worker_pool(slots, {NODE_LABEL: ray_node_id()})  # its containers name this node

    def node_id(self) -> str:
        return ray_node_id()

    def prewarm(self, task_dir: str) -> bool:
        return prewarm(self.pool, task_dir, self.episode.env, self.images.get(task_dir))

    def pool_stats(self) -> dict:
        p = self.pool
        return {"warm_hits": p.warm_hits, "cold_starts": p.cold_starts} if p is not None else {}

    def generate(self, req: EpisodeRequest, version: int) -> GeneratedEpisode:
        """One episode of `req` scored (`training.generator.EpisodeWorker`)."""
        image = self.images.get(req.task_dir)
        try:
            if self.episode.branching.enabled:  # a tree of episodes (`training.branching`)
                return run_tree(req, self.sampler, self.tokenizer, self.episode, self.episode.branching, image=image,
                                pool=self.pool, start_version=version)
            r = run_episode(req, self.sampler, self.tokenizer, self.episode, image=image, pool=self.pool,
                            start_version=version)
        except InfraError as e:
            return GeneratedEpisode(infra_error=str(e), infra_kind=e.kind)
        return GeneratedEpisode(rollout=r)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close(in_use=True)
