"""`LearnerRank`: one data-parallel learner rank as a Ray actor.

A plain class: `training.cluster.actors.LearnerGroup` wraps it with `ray.remote` where the
ranks are created. Importing this module imports neither Ray nor torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tmax.common.records import CheckpointExtra
from tmax.training.net import free_port, node_ip, ray_node_id
from tmax.training.weights.learner_side import WeightSourceMixin

if TYPE_CHECKING:
    from tmax.training.learner.learner import Learner, LearnerConfig

# Gloo / NCCL collectives of the learner group give up after this long (a dead rank).
GROUP_TIMEOUT_S = 600.0


class LearnerRank(WeightSourceMixin):
    """One data-parallel learner rank (FSDP2-sharded or replicated, per
    `LearnerConfig.strategy`); rank 0 is also rank 0 of the weight group for a
    process-group transport (`WeightSourceMixin`)."""

    def __init__(self, threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.learner: Learner | None = None
        self.rank = 0

    def node_id(self) -> str:
        return ray_node_id()

    def rendezvous(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def setup(self, rank: int, world: int, host: str, port: int, model_dir: str, lcfg: LearnerConfig,
              resume: str | None) -> int:
        from tmax.training.learner.learner import Learner
        from tmax.training.learner.parallel import data_parallel, init_learner_group

        ctx = init_learner_group(rank, world, host, port, timeout_s=GROUP_TIMEOUT_S)
        self.rank = rank
        dp = data_parallel(ctx, lcfg.strategy)
        self.learner = Learner.load(resume, lcfg, dp) if resume else Learner(model_dir, lcfg, dp)
        return rank

    def train_step(self, samples: list, world: int) -> dict:
        from tmax.training.learner.packing import shard

        return self.learner.train_step(shard(samples, self.rank, world))

    def named_weights(self) -> dict:
        w = self.learner.named_weights()  # a collective once the backend shards
        # CPU tensors: engines on other nodes read them from the object store.
        return {k: v.cpu() for k, v in w.items()} if self.rank == 0 else {}

    def save(self, path: str, step: int, extra: CheckpointExtra) -> str:
        return str(self.learner.save(path, step, extra))

    def restore(self, path: str, lr_scale: float) -> int:
        return self.learner.restore(path, lr_scale)

    def close(self) -> None:
        from tmax.training.learner.parallel import destroy_learner_group

        destroy_learner_group()
