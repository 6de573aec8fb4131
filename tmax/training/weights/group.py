"""The weight process group {learner rank 0 = rank 0, engine workers = ranks 1..} and the
two ends of a broadcast over it.

A standalone process group built from its own TCPStore, so it collides neither with the
learners' default group nor with an engine's tensor-parallel group. Its world is fixed
when it forms: an engine that joins later (one Ray restarted) means a new group for all
(`learner_side.WeightSync` re-forms it)."""

from __future__ import annotations

from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from tmax.training.weights.protocol import DEFAULT_BUCKET_MB, WeightUpdate, bucket_numel, dtype_of, make_update, pack_bucket, unpack_bucket


class WeightGroup:
    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
    ):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        store = dist.PrefixStore("tmax-weights", self._store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            # NCCL needs one GPU per rank: learner 0 and each engine worker own distinct GPUs.
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(self.device)
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")

    def broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def close(self) -> None:
        # ProcessGroupNCCL frees its communicators on shutdown; gloo needs nothing.
        if hasattr(self.pg, "shutdown"):
            try:
                self.pg.shutdown()
            except Exception:
                pass


class WeightSender:
    """Rank 0's end. `prepare` returns the update to hand to every engine; `send` then
    broadcasts its buckets (while the engines receive)."""

    def __init__(self, group: WeightGroup, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.group, self.bucket_mb = group, bucket_mb
        self._pending: tuple[WeightUpdate, list[torch.Tensor]] | None = None

    def prepare(self, weights: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        update = make_update(weights, version, self.group.backend, self.bucket_mb)
        self._pending = (update, list(weights.values()))
        return update

    def send(self) -> None:
        if self._pending is None:
            raise RuntimeError("send() without prepare()")
        update, tensors = self._pending
        self._pending = None
        for _, idx in update.buckets:
            self.group.broadcast(pack_bucket([tensors[i].to(self.group.device) for i in idx]))


def receive(group: WeightGroup, update: WeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker's end: (name, tensor) for every weight of `update`, ready for
    `model.load_weights(...)` or a state-dict copy. Tensors are views of a bucket and
    only valid until the next bucket arrives, so copy them while iterating."""
    for b, (dtype, _) in enumerate(update.buckets):
        flat = torch.empty(bucket_numel(update, b), dtype=dtype_of(dtype), device=group.device)
        group.broadcast(flat)
        yield from unpack_bucket(update, b, flat)
