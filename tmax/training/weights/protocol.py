"""The update manifest of a process-group weight sync, and its buckets.

A process-group sync (`gloo`, `nccl`) is a `WeightUpdate` (version + manifest of names /
shapes / dtypes + the buckets) handed to every engine as a Ray call argument (as JSON to
the vLLM workers: `/collective_rpc` only takes strings), then one broadcast per bucket in
manifest order; each receiver unpacks the buckets into (name, tensor) pairs and loads
them. Pure torch: no process group, no Ray.
"""

from __future__ import annotations

from typing import Iterator

import torch
from pydantic import BaseModel

from tmax.training.weights.transports import DEFAULT_BUCKET_MB, GROUP_TRANSPORTS


class WeightUpdate(BaseModel):
    """What every engine is told before a process-group sync (as JSON to a vLLM worker:
    `model_dump_json`). `buckets` lists, per bucket, its dtype and the manifest indices
    it holds."""

    version: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    buckets: list[tuple[str, list[int]]]
    transport: str  # "gloo" | "nccl"
    total_bytes: int = 0


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def plan_buckets(weights: dict[str, torch.Tensor], bucket_mb: float = DEFAULT_BUCKET_MB) -> list[tuple[str, list[int]]]:
    """Group tensors (in name order) into per-dtype buckets of at most `bucket_mb` (a tensor
    larger than a bucket gets its own)."""
    limit = int(bucket_mb * 1024 * 1024)
    buckets: list[tuple[str, list[int]]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    for i, (_, t) in enumerate(weights.items()):
        key = str(t.dtype).replace("torch.", "")
        idx, size = open_.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if idx and size + nbytes > limit:
            buckets.append((key, idx))
            idx, size = [], 0
        idx.append(i)
        open_[key] = (idx, size + nbytes)
    buckets += [(k, idx) for k, (idx, _) in open_.items() if idx]
    return buckets


def make_update(
    weights: dict[str, torch.Tensor], version: int, transport: str, bucket_mb: float = DEFAULT_BUCKET_MB
) -> WeightUpdate:
    if transport not in GROUP_TRANSPORTS:
        raise ValueError(f"a weight update manifest is for {' / '.join(GROUP_TRANSPORTS)}, not {transport!r}")
    return WeightUpdate(
        version=version,
        names=list(weights),
        shapes=[tuple(t.shape) for t in weights.values()],
        dtypes=[str(t.dtype).replace("torch.", "") for t in weights.values()],
        buckets=plan_buckets(weights, bucket_mb),
        transport=transport,
        total_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
    )


def pack_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def bucket_numel(update: WeightUpdate, bucket: int) -> int:
    return sum(_numel(update.shapes[i]) for i in update.buckets[bucket][1])


def unpack_bucket(update: WeightUpdate, bucket: int, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) pairs of one received bucket, checked against the manifest first."""
    expected = bucket_numel(update, bucket)
    if flat.numel() != expected:
        raise ValueError(f"bucket {bucket}: {flat.numel()} elements received, manifest says {expected}")
    off = 0
    for i in update.buckets[bucket][1]:
        n = _numel(update.shapes[i])
        yield update.names[i], flat[off : off + n].view(update.shapes[i])
        off += n


def load_into(model: torch.nn.Module, pairs: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Copy received weights into a plain torch model by name; every parameter must come."""
    params = dict(model.named_parameters())
    targets = dict(params)
    targets.update({n: b for n, b in model.named_buffers() if b is not None})
    seen: set[str] = set()
    with torch.no_grad():
        for name, t in pairs:
            if name not in targets:
                raise KeyError(f"weight {name!r} is not in {type(model).__name__}")
            targets[name].copy_(t)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{len(missing)} parameter(s) not received, e.g. {missing[:3]}")
    return len(seen)
