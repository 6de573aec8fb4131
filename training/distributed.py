"""torch.distributed for learners, and the weight broadcast from learner rank 0 to engines.

Learners: N ranks of one process group (NCCL on GPU, gloo on CPU), each model sharded
with FSDP2 (`fully_shard`, which runs on both backends), so CPU tests exercise the same
code as GPU runs. FSDP2 *averages* gradients over ranks, while the DPPO loss wants the
sum of every rank's token-sum divided by the global loss-token count N. So a rank
computes `policy_loss(..., denominator=N)` with N from `global_count`, and multiplies the
loss by `ctx.grad_scale` (= world size) before backward: the averaged gradient is then
exactly the single-process gradient of the whole batch, whatever the token counts per
rank (reference §1.8: "multiplied by the DP world size to undo the averaging").

Weights: after every step the full weights (gathered from the shards, a collective over
all learner ranks) go from learner rank 0 to every engine. The protocol is the same on
every transport:

1. rank 0 builds a `WeightUpdate` (version + manifest of names / shapes / dtypes, and,
   for the object-store transport, a reference to the packed buckets);
2. the update travels to every engine as an ordinary Ray call argument;
3. for a process-group transport (NCCL on GPU, gloo on CPU) rank 0 broadcasts the
   buckets in manifest order on a separate group {learner 0, engine 1..E} while every
   engine receives them; for the object store each engine reads the buckets itself;
4. the engine unpacks the buckets into (name, tensor) pairs and loads them.

The weight group is a standalone process group built from its own TCPStore, so it does
not collide with the learners' default group nor with an engine's tensor-parallel group.

Import-safe without a GPU and without Ray (Ray is only imported by the object-store path).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

DEFAULT_BUCKET_MB = 256


# -- learner process group -------------------------------------------------------------


@dataclass
class RankContext:
    rank: int
    world_size: int
    backend: str  # "nccl" | "gloo" | "none" (single process, no group)
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def grad_scale(self) -> float:
        """Factor for the loss before backward: FSDP2 averages gradients over ranks."""
        return float(self.world_size)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This host's address as other nodes see it (Ray's view when Ray is running)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def pick_backend(backend: str | None = None) -> str:
    if backend:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs a CUDA GPU; none is visible (use gloo on CPU)")
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_learner_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> RankContext:
    """Join the learners' process group. Ray sets CUDA_VISIBLE_DEVICES per actor, so the
    learner's GPU is always cuda:0 inside it."""
    backend = pick_backend(backend)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if world_size == 1:
        return RankContext(0, 1, "none", device)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return RankContext(rank, world_size, backend, device)


def destroy_learner_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def global_count(local: float | int | torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """Sum of `local` over all learner ranks (the global loss-token denominator)."""
    t = torch.as_tensor(local, dtype=torch.float64).reshape(()).clone()
    if ctx.world_size == 1:
        return t
    # NCCL reduces on the GPU only; the value is tiny either way.
    t = t.to(ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def global_max(local: int, ctx: RankContext) -> int:
    """Largest `local` over ranks. FSDP2 forwards are collectives, so every rank must run
    the same number of micro-batches: a rank with fewer pads with all-masked ones."""
    if ctx.world_size == 1:
        return int(local)
    t = torch.tensor(float(local), dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_stats(values: torch.Tensor, max_mask: list[bool], ctx: RankContext) -> torch.Tensor:
    """Combine per-rank statistic vectors: sum, or max where `max_mask` is True."""
    values = values.to(torch.float64)
    if ctx.world_size == 1:
        return values
    dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    m = torch.tensor(max_mask, dtype=torch.bool)
    s, mx = values.masked_fill(m, 0.0).to(dev), values.masked_fill(~m, float("-inf")).to(dev)
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    return torch.where(m, mx.cpu(), s.cpu())


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (HF causal LMs keep them in model.layers)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers to shard")
    return list(layers)


def shard_model(model: torch.nn.Module, ctx: RankContext, bf16: bool | None = None) -> torch.nn.Module:
    """FSDP2: shard every decoder layer, then the root. With `bf16` (default on GPU) the
    blocks compute in bf16 with fp32 master weights and fp32 gradient reduction, while
    the LM head keeps fp32 compute (its own FSDP unit with an fp32 policy), the fp32
    LM-head trick of the reference §4.5. Without a process group (`backend == "none"`)
    the model is returned unchanged; a 1-rank group still shards (single-GPU checks)."""
    if ctx.backend == "none":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = ctx.backend == "nccl" if bf16 is None else bf16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    head = getattr(model, "lm_head", None)
    if head is not None and bf16:
        fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def full_weights(model: torch.nn.Module, ctx: RankContext, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Gather the full parameters (HF names). A collective: every learner rank must call
    it; rank 0 gets the tensors, the other ranks an empty dict."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.data
        if ctx.is_main:
            t = t.detach()
            out[name] = t.to(dtype) if dtype is not None else t
    for name, b in model.named_buffers():
        if ctx.is_main and b is not None and not name.endswith("inv_freq"):
            out[name] = b.detach()
    return out


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm over all shards (DTensor-aware), clipped in place."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# -- weight protocol ---------------------------------------------------------------------


@dataclass
class WeightUpdate:
    """What every engine is told before a sync. `buckets` lists, per bucket, its dtype and
    the manifest indices it holds; `ref` is the object-store reference (object store only)."""

    version: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    buckets: list[tuple[str, list[int]]]
    transport: str  # "object_store" | "gloo" | "nccl" | "ipc"
    ref: Any = None
    total_bytes: int = 0

    def to_json(self) -> str:
        """The manifest as JSON, for a process-group transport: an engine worker behind
        vLLM's `/collective_rpc` only takes string arguments. An object-store reference
        cannot travel that way."""
        if self.ref is not None:
            raise ValueError("an update that carries an object-store reference has no JSON form")
        return json.dumps({
            "version": self.version, "names": self.names, "shapes": [list(s) for s in self.shapes],
            "dtypes": self.dtypes, "buckets": [[d, list(idx)] for d, idx in self.buckets],
            "transport": self.transport, "total_bytes": self.total_bytes,
        })

    @classmethod
    def from_json(cls, text: str) -> "WeightUpdate":
        d = json.loads(text)
        return cls(
            version=int(d["version"]),
            names=list(d["names"]),
            shapes=[tuple(int(x) for x in s) for s in d["shapes"]],
            dtypes=list(d["dtypes"]),
            buckets=[(str(dt), [int(i) for i in idx]) for dt, idx in d["buckets"]],
            transport=str(d["transport"]),
            total_bytes=int(d.get("total_bytes", 0)),
        )


def _dtype(name: str) -> torch.dtype:
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
    # "ipc": the packed buckets are handed to a process on the same GPU by CUDA IPC handles
    # (torch.multiprocessing), since NCCL cannot put two ranks on one GPU.
    if transport not in ("object_store", "gloo", "nccl", "ipc"):
        raise ValueError(f"unknown weight transport {transport!r}")
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


def _bucket_numel(update: WeightUpdate, bucket: int) -> int:
    total = 0
    for i in update.buckets[bucket][1]:
        n = 1
        for s in update.shapes[i]:
            n *= s
        total += n
    return total


def unpack_bucket(update: WeightUpdate, bucket: int, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) pairs of one received bucket, checked against the manifest first."""
    expected = _bucket_numel(update, bucket)
    if flat.numel() != expected:
        raise ValueError(f"bucket {bucket}: {flat.numel()} elements received, manifest says {expected}")
    off = 0
    for i in update.buckets[bucket][1]:
        n = 1
        for s in update.shapes[i]:
            n *= s
        yield update.names[i], flat[off : off + n].view(update.shapes[i])
        off += n


class WeightGroup:
    """The standalone process group {learner rank 0 = rank 0, engine i = rank i + 1}."""

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
    """Learner rank 0's side. `prepare` returns the update to hand to every engine;
    `send` then performs the broadcasts (process-group transports only)."""

    def __init__(self, transport: str, group: WeightGroup | None = None, bucket_mb: float = DEFAULT_BUCKET_MB):
        if transport in ("gloo", "nccl") and group is None:
            raise ValueError(f"transport {transport} needs a WeightGroup")
        self.transport, self.group, self.bucket_mb = transport, group, bucket_mb
        self._pending: tuple[WeightUpdate, list[torch.Tensor]] | None = None

    def prepare(self, weights: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        update = make_update(weights, version, self.transport, self.bucket_mb)
        tensors = list(weights.values())
        if self.transport == "object_store":
            import ray

            flats = [pack_bucket([tensors[i].cpu() for i in idx]) for _, idx in update.buckets]
            # A list wrapper keeps the ref un-resolved when the update is passed to a task.
            update.ref = [ray.put(flats)]
        else:
            self._pending = (update, tensors)
        return update

    def send(self) -> None:
        if self.transport == "object_store":
            return
        if self._pending is None:
            raise RuntimeError("send() without prepare()")
        update, tensors = self._pending
        self._pending = None
        assert self.group is not None
        for _, idx in update.buckets:
            flat = pack_bucket([tensors[i].to(self.group.device) for i in idx])
            self.group.broadcast(flat)


class WeightReceiver:
    """An engine's side: yields (name, tensor) for every weight of the update, ready for
    `model.load_weights(...)` or a state-dict copy. Tensors are views of a bucket and
    only valid until the next bucket arrives, so copy them while iterating."""

    def __init__(self, group: WeightGroup | None = None):
        self.group = group

    def receive(self, update: WeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        if update.transport == "object_store":
            import ray

            flats = ray.get(update.ref[0])
            for b, flat in enumerate(flats):
                yield from unpack_bucket(update, b, flat)
            return
        if self.group is None:
            raise RuntimeError(f"update uses transport {update.transport} but this receiver has no WeightGroup")
        for b, (dtype, _) in enumerate(update.buckets):
            flat = torch.empty(_bucket_numel(update, b), dtype=_dtype(dtype), device=self.group.device)
            self.group.broadcast(flat)
            yield from unpack_bucket(update, b, flat)


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


class WeightSourceMixin:
    """Learner rank 0's end of the weight group, as methods of a learner actor (Ray calls
    them). The actor sets `self.learner` (a `training.learner.Learner`) and, when it is
    one of several learner ranks, `self.rank`.

    A sync is `prepare_weights(version)` on every learner rank (gathering the full
    weights is a collective), the returned update handed to every engine's receive, and
    `send_weights()` on rank 0 while the engines receive."""

    rank: int = 0
    _weight_group: WeightGroup | None = None
    _weight_sender: WeightSender | None = None

    def learner_device_type(self) -> str:
        return torch.device(getattr(self.learner, "device", "cpu")).type  # type: ignore[attr-defined]

    def weight_rendezvous(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str,
                          bucket_mb: float = DEFAULT_BUCKET_MB, timeout_s: float = 300.0) -> int:
        """Become rank 0 (and the TCPStore server) of the group; blocks until every engine
        worker has joined too."""
        if self.rank != 0:
            raise RuntimeError("only learner rank 0 belongs to the weight group")
        self.leave_weight_group()
        device = getattr(self.learner, "device", None) if backend == "nccl" else "cpu"  # type: ignore[attr-defined]
        self._weight_group = WeightGroup(host, port, 0, world_size, backend, device=device, timeout_s=timeout_s)
        self._weight_sender = WeightSender(backend, self._weight_group, bucket_mb)
        return world_size

    def prepare_weights(self, version: int) -> WeightUpdate | None:
        weights = self.learner.named_weights()  # type: ignore[attr-defined]
        if self.rank != 0:
            return None
        if self._weight_sender is None:
            raise RuntimeError("prepare_weights before join_weight_group")
        return self._weight_sender.prepare(weights, version)

    def send_weights(self) -> None:
        if self._weight_sender is None:
            raise RuntimeError("send_weights before join_weight_group")
        self._weight_sender.send()

    def leave_weight_group(self) -> None:
        group, self._weight_group, self._weight_sender = self._weight_group, None, None
        if group is not None:
            group.close()
