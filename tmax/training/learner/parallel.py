"""torch.distributed for learners: the process group, FSDP2 sharding, full weights.

Learners: N ranks of one process group (NCCL on GPU, gloo on CPU), each model sharded
with FSDP2 (`fully_shard`, which runs on both backends), so CPU tests exercise the same
code as GPU runs. FSDP2 *averages* gradients over ranks, while the DPPO loss wants the
sum of every rank's token-sum divided by the global loss-token count N. So a rank
computes `policy_loss(..., denominator=N)` with N summed over ranks
(`DataParallel.all_reduce`), and multiplies the loss by `ctx.grad_scale` (= world size)
before backward: the averaged gradient is then exactly the single-process gradient of
the whole batch, whatever the token counts per rank.

Weights: after every step the full weights (`full_weights`, gathered from the shards, a
collective over all learner ranks) go from learner rank 0 to every engine: that sync is
`training.weights`.

Import-safe without a GPU and without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
    LM-head trick (fp32 logits keep the trainer's log-probs close to the sampler's). Without a process group (`backend == "none"`)
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


# -- data-parallel backends of the learner ---------------------------------------------


STRATEGIES = ("fsdp", "replicate")

class DataParallel:
    """Single-process default; the interface a data-parallel backend implements.

    After `backward`, `.grad` must hold the gradient of the *global* token-mean loss. A
    backend that sums gradients over ranks keeps `loss_scale = 1`; one that averages them
    (DDP, FSDP2) sets `loss_scale = world_size`. `all_reduce` takes and returns CPU
    tensors (an NCCL backend moves them to the GPU and back). `wrap` may shard the
    module the learner runs its forward through (before the optimizer is made); the
    state methods then gather / scatter what the shards hold."""

    rank: int = 0
    world_size: int = 1
    loss_scale: float = 1.0
    strategy: str = "single"

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t

    def wrap(self, net: torch.nn.Module) -> torch.nn.Module:
        return net

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Leave the *sum* over ranks of every gradient in `.grad`."""

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip to the global gradient norm; returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """HF-named full tensors (rank 0; other ranks may get an empty dict)."""
        return model.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """`optimizer.state_dict()` with full tensors, as rank 0 writes it to disk."""
        return optimizer.state_dict()

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Full HF-named tensors (every rank holds them) into the model, in place; with
        `strict=False` a part of the model (a LoRA adapter's tensors)."""
        with torch.no_grad():
            model.load_state_dict(state, strict=strict)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


class TorchDataParallel(DataParallel):
    """Replicated weights on an initialised torch.distributed group; gradients summed with
    one all-reduce per parameter. Every rank feeds its own share of the batch. `device`:
    where the group reduces (the GPU for NCCL); None reduces the CPU tensors in place."""

    strategy = "replicate"

    def __init__(self, device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed.init_process_group() first")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device) if device is not None else None

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        t = t.clone() if self.device is None else t.to(self.device, copy=True)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX if op == "max" else self._dist.ReduceOp.SUM)
        return t.cpu()

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._dist.all_reduce(p.grad, op=self._dist.ReduceOp.SUM)


class FSDPDataParallel(TorchDataParallel):
    """FSDP2 over the learner group of `ctx` (a `training.learner.parallel.RankContext`).

    Parameters, gradients and AdamW state are DTensors sharded on dim 0. FSDP2
    reduce-scatters the *mean* gradient during backward, so `loss_scale` is the world
    size and `reduce_gradients` has nothing left to do. The model is sharded without
    FSDP's mixed precision: the learner's own `autocast` gives the same numerics as one
    process, and a tied LM head (one parameter shared with the embeddings) cannot get a
    separate fp32 FSDP unit anyway."""

    strategy = "fsdp"

    def __init__(self, ctx) -> None:
        super().__init__(ctx.device if ctx.backend == "nccl" else None)
        self.ctx = ctx
        self.loss_scale = float(ctx.grad_scale)

    def wrap(self, net: torch.nn.Module) -> torch.nn.Module:
        return shard_model(net, self.ctx, bf16=False)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        # Norms of DTensor gradients come out as DTensors reduced over the shards, so the
        # clip coefficient is the global one on every rank.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        

        return full_weights(model, self.ctx)

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Every rank keeps its own shard of each full tensor: no communication."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """Gathered tensor by tensor (each `full_tensor` is an all-gather, in the same
        index / key order on every rank); only rank 0 keeps them, on the CPU."""
        state = optimizer.state_dict()
        full: dict = {}
        for idx in sorted(state["state"]):
            entry = {}
            for key, v in state["state"][idx].items():
                if hasattr(v, "full_tensor"):
                    v = v.full_tensor()
                entry[key] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
            full[idx] = entry
        return {"state": full if self.rank == 0 else {}, "param_groups": state["param_groups"]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Every rank holds the full state (read from the checkpoint) and keeps its own
        shard of each tensor, laid out like the parameter: no communication."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = [p for g in optimizer.param_groups for p in g["params"]]
        local: dict = {}
        for idx, entry in state["state"].items():
            p = params[int(idx)]
            local[idx] = {
                key: distribute_tensor(v.to(p.device_mesh.device_type), p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape)
                else v
                for key, v in entry.items()
            }
        optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})


def data_parallel(ctx, strategy: str = "fsdp") -> DataParallel:
    """The backend for a learner rank (`ctx`: a `training.learner.parallel.RankContext`): the
    single-process one without a group, else `strategy` over the group."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if ctx.world_size == 1:
        return DataParallel()
    if strategy == "fsdp":
        return FSDPDataParallel(ctx)
    return TorchDataParallel(ctx.device if ctx.backend == "nccl" else None)
