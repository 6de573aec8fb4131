"""The DPPO learner: HF transformers model + torch, one optimizer step per batch.

A `TrainSample` is one trajectory as the sampler saw it: `prompt_ids` then `ids`, where
`ids` interleaves sampled tokens (mask 1, the sampler's post-temperature logprob) with
observation / template tokens (mask 0). The learner packs several samples into one row
(position ids restart at 0 per sample, which transformers turns into a block-diagonal
causal mask), runs the backbone, and projects only the hidden states that predict a loss
token through the LM head, in fp32, chunk by chunk. Token t is predicted from position
t - 1, so the loss tokens are exactly the sampled tokens.

Data parallelism is behind `DataParallel`: the learner all-reduces the loss-token count
(global token-mean denominator), the number of packs (so every rank runs the same number of
forward passes, which FSDP's collectives need) and the statistics, and asks the backend to
reduce gradients. `SingleProcess` is the default for one process. With several ranks
(`LearnerConfig.strategy`, backends made by `data_parallel`):

* "fsdp" (`FSDPDataParallel`, the default on gloo and NCCL): FSDP2 shards parameters,
  gradients and AdamW state over the ranks; gradients are reduce-scattered (averaged) in
  backward, so the loss is scaled by the world size. Full weights are gathered for the
  engines and checkpoints (a collective: every rank calls `named_weights` / `save`).
* "replicate" (`TorchDataParallel`): every rank holds the whole model and optimizer and
  gradients are summed with one all-reduce per parameter.

Checkpoints look the same whatever the strategy and world size: an HF model directory
and an index-keyed `optimizer.state_dict()` of full tensors (FSDP gathers it on rank 0
and every rank cuts its own shard back out on resume), so any run resumes any other's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from training import checkpoint as ckpt
from training.dppo import LossConfig, LossStats, policy_loss

if TYPE_CHECKING:
    from agents.policy import TokenTrace


@dataclass
class TrainSample:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]  # sampler logprob per id (0.0 where mask is 0)
    mask: list[int]  # 1 = sampled by the policy (trained on), 0 = observation / template
    advantage: float

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)

    @classmethod
    def from_trace(cls, trace: "TokenTrace", advantage: float) -> "TrainSample":
        """The exact token stream a TokenPolicy recorded, with its sequence advantage."""
        return cls(list(trace.prompt_ids), list(trace.ids), list(trace.logprobs), list(trace.mask), float(advantage))


STRATEGIES = ("fsdp", "replicate")


@dataclass
class LearnerConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # Linear LR warmup over the first optimizer steps (0 = none). Adam's first bias-corrected
    # steps move every weight by ~lr whatever the gradient size; warmup tames them.
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # logits / T, matching the sampler's processed logprobs
    pack_length: int = 67584  # max tokens per packed row (prompt + response)
    head_chunk: int = 1024  # loss positions per fp32 LM-head chunk (recomputed in backward)
    gradient_checkpointing: bool = False
    # Parameter (and optimizer state) dtype. Keep float32 master weights and set `autocast`
    # for bf16 compute: AdamW on bf16 parameters drops updates below bf16 resolution, which
    # at LR 1e-6 is most of them.
    dtype: str = "float32"
    autocast: str | None = None  # "bfloat16" / "float16": body matmuls in that dtype
    device: str = "auto"  # "auto" = cuda when available, else cpu
    seed: int = 0
    # Data parallelism over several learner ranks (ignored with one): "fsdp" shards the
    # model and optimizer state with FSDP2, "replicate" keeps a full copy per rank and
    # all-reduces gradients. FSDP2 is the default on NCCL and on gloo alike: it takes the
    # same step as one process on both (tests/test_learner.py), divides parameter and
    # optimizer memory by the world size, and CPU tests then run the GPU code path.
    strategy: str = "fsdp"
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.pack_length < 2 or self.head_chunk < 1:
            raise ValueError("pack_length must be >= 2 and head_chunk >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.autocast not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast must be None, bfloat16 or float16, got {self.autocast!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")


# ---------------------------------------------------------------------------- parallelism


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

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


SingleProcess = DataParallel


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
    """FSDP2 over the learner group of `ctx` (a `training.distributed.RankContext`).

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
        from training.distributed import shard_model

        return shard_model(net, self.ctx, bf16=False)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        # Norms of DTensor gradients come out as DTensors reduced over the shards, so the
        # clip coefficient is the global one on every rank.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from training.distributed import full_weights

        return full_weights(model, self.ctx)

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
    """The backend for a learner rank (`ctx`: a `training.distributed.RankContext`): the
    single-process one without a group, else `strategy` over the group."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if ctx.world_size == 1:
        return DataParallel()
    if strategy == "fsdp":
        return FSDPDataParallel(ctx)
    return TorchDataParallel(ctx.device if ctx.backend == "nccl" else None)


def shard(samples: list[TrainSample], rank: int, world_size: int) -> list[TrainSample]:
    """This rank's share, balanced by token count (longest first onto the lightest rank)."""
    loads = [0] * world_size
    mine: list[TrainSample] = []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        r = min(range(world_size), key=lambda k: loads[k])
        loads[r] += len(samples[i])
        if r == rank:
            mine.append(samples[i])
    return mine


# ---------------------------------------------------------------------------- packing


@dataclass
class Pack:
    """One packed row. `pred_pos[j]` is the row position whose hidden state predicts
    `targets[j]` (the token at pred_pos[j] + 1 of the same sample)."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    pred_pos: torch.Tensor  # [n]
    targets: torch.Tensor  # [n]
    old_logprobs: torch.Tensor  # [n]
    advantages: torch.Tensor  # [n]
    loss_mask: torch.Tensor  # [n]
    spans: list[tuple[int, int, int]]  # (sample index, first response pred index in this pack, count)


def pack_samples(samples: list[TrainSample], pack_length: int) -> list[list[int]]:
    """Sample indices per row, first-fit decreasing; a sample longer than `pack_length`
    gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        n = len(samples[i])
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(pack_length - n)
    return rows


def build_pack(samples: list[TrainSample], indices: list[int], all_positions: bool = False) -> Pack:
    """Tensors of one row. Targets are the mask-1 tokens, or with `all_positions` every
    response token (for diagnostics)."""
    ids: list[int] = []
    pos: list[int] = []
    pred: list[int] = []
    tgt: list[int] = []
    old: list[float] = []
    adv: list[float] = []
    lmask: list[float] = []
    spans: list[tuple[int, int, int]] = []
    for i in indices:
        s = samples[i]
        offset, first = len(ids), len(pred)
        ids.extend(s.prompt_ids)
        ids.extend(s.ids)
        pos.extend(range(len(s)))
        for k, (tok, lp, m) in enumerate(zip(s.ids, s.logprobs, s.mask)):
            if not (m or all_positions):
                continue
            # Token at sequence position p is predicted by the hidden state at p - 1.
            pred.append(offset + len(s.prompt_ids) + k - 1)
            tgt.append(tok)
            old.append(lp if m else 0.0)
            adv.append(s.advantage if m else 0.0)
            lmask.append(float(m))
        spans.append((i, first, len(pred) - first))
    return Pack(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        pred_pos=torch.tensor(pred, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        old_logprobs=torch.tensor(old, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        loss_mask=torch.tensor(lmask, dtype=torch.float32),
        spans=spans,
    )


def validate_samples(samples: list[TrainSample], vocab_size: int) -> None:
    for n, s in enumerate(samples):
        where = f"train sample {n}"
        if not s.prompt_ids:
            raise ValueError(f"{where}: empty prompt_ids (the first response token needs a context)")
        if not (len(s.ids) == len(s.logprobs) == len(s.mask)):
            raise ValueError(
                f"{where}: ids, logprobs and mask differ in length ({len(s.ids)}, {len(s.logprobs)}, {len(s.mask)})"
            )
        if any(m not in (0, 1) for m in s.mask):
            raise ValueError(f"{where}: mask values must be 0 or 1")
        bad = [t for t in (*s.prompt_ids, *s.ids) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        for k, (lp, m) in enumerate(zip(s.logprobs, s.mask)):
            if m and not (math.isfinite(lp) and lp <= 1e-4):
                raise ValueError(f"{where}: sampled token {k} has sampler logprob {lp} (need a finite value <= 0)")
        if not math.isfinite(s.advantage):
            raise ValueError(f"{where}: advantage {s.advantage} is not finite")


# ---------------------------------------------------------------------------- learner


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _LossForward(torch.nn.Module):
    """The learner's forward (backbone, then the fp32 LM head at the loss positions) as
    one module call. FSDP2 gathers the root unit's parameters (embeddings, final norm, LM
    head) around the root module's forward and backward only, so everything that touches
    them must run inside one. The attribute names are the ones `shard_model` looks for."""

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Module, fn):
        super().__init__()
        self.model, self.lm_head = backbone, head
        self._fn = fn

    def forward(self, input_ids, position_ids, pred_pos, targets):
        return self._fn(input_ids, position_ids, pred_pos, targets)


class Learner:
    def __init__(self, model_dir: str | Path, cfg: LearnerConfig | None = None, dp: DataParallel | None = None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg or LearnerConfig()
        self.dp = dp or DataParallel()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no HF model at {self.model_dir} (config.json missing)")
        torch.manual_seed(self.cfg.seed)
        self.device = _resolve_device(self.cfg.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=getattr(torch, self.cfg.dtype)
        ).to(self.device)
        self.model.config.use_cache = False
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.backbone = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.vocab_size = self.head.weight.shape[0]
        if self.dp.world_size > 1 and self.dp.strategy != self.cfg.strategy:
            raise ValueError(f"strategy {self.cfg.strategy!r} but the data-parallel backend is {self.dp.strategy!r}")
        # Before sharding: a local forward, no collectives.
        self.packing = self._packing_works()
        # Sharded (FSDP) before the optimizer exists, so AdamW's state is made per shard.
        self.net = self.dp.wrap(_LossForward(self.backbone, self.head, self._pack_logprobs))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay
        )
        self.step = 0
        self.extra: dict = {}

    # -- forward -----------------------------------------------------------------------

    def _packing_works(self) -> bool:
        """Packing relies on the attention backend honouring position-id restarts; check it
        once on random tokens instead of trusting every architecture / backend to."""
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            a = torch.randint(0, self.vocab_size, (1, 6), generator=g).to(self.device)
            b = torch.randint(0, self.vocab_size, (1, 5), generator=g).to(self.device)
            pos = torch.cat([torch.arange(6), torch.arange(5)])[None].to(self.device)
            packed = self._hidden(torch.cat([a, b], 1), pos)[0, 6:].float()
            alone = self._hidden(b, torch.arange(5)[None].to(self.device))[0].float()
            # Relative error: a few bf16 ulps when packing works, O(1) when it leaks.
            return bool((packed - alone).abs().mean() <= 0.02 * alone.abs().mean())

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        dtype = getattr(torch, self.cfg.autocast) if self.cfg.autocast else None
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state

    def _head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """fp32 projection + fp32 log-softmax, gathered at the targets (autocast off, so a
        bf16 body never drags the head down to bf16)."""
        with torch.autocast(self.device.type, enabled=False):
            weight = self.head.weight.float()
            bias = self.head.bias.float() if getattr(self.head, "bias", None) is not None else None
            logits = F.linear(hidden.float(), weight, bias) / self.cfg.temperature
            return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    def pack_logprobs(self, pack: Pack) -> torch.Tensor:
        """Trainer logprobs of `pack.targets` (with gradient). Under FSDP a collective."""
        dev = self.device
        return self.net(pack.input_ids.to(dev), pack.position_ids.to(dev), pack.pred_pos.to(dev), pack.targets.to(dev))

    def _pack_logprobs(self, input_ids, position_ids, pred_pos, targets) -> torch.Tensor:
        hidden = self._hidden(input_ids, position_ids)[0]
        sel = hidden.index_select(0, pred_pos)
        chunk = self.cfg.head_chunk
        if sel.shape[0] <= chunk:
            return self._head_logprobs(sel, targets)
        # The [n, vocab] fp32 logits of one chunk at a time: recomputed in backward instead
        # of being kept for the whole row.
        parts = [
            checkpoint(self._head_logprobs, sel[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
            for i in range(0, sel.shape[0], chunk)
        ]
        return torch.cat(parts)

    def _rows(self, samples: list[TrainSample]) -> list[list[int]]:
        if self.packing:
            return pack_samples(samples, self.cfg.pack_length)
        return [[i] for i in range(len(samples))]

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Trainer logprob of every response token of every sample (aligned with `ids`).
        Under FSDP every rank calls it (with its own samples, possibly none)."""
        validate_samples(samples, self.vocab_size)
        out: list[list[float]] = [[] for _ in samples]
        rows = self._rows(samples)
        # FSDP forwards are collectives: run as many as the busiest rank.
        passes = len(rows)
        if self.dp.strategy == "fsdp":
            passes = int(self.dp.all_reduce(torch.tensor([float(len(rows))]), op="max")[0])
        for r in range(passes):
            if r >= len(rows):
                self.pack_logprobs(build_pack([TrainSample([0], [0], [0.0], [1], 0.0)], [0]))
                continue
            pack = build_pack(samples, rows[r], all_positions=True)
            lp = self.pack_logprobs(pack).float().cpu().tolist()
            for i, first, count in pack.spans:
                out[i] = lp[first : first + count]
        if passes and hasattr(self.net, "reshard"):
            # FSDP2 keeps the root unit gathered after a forward, for the backward that
            # normally follows; without one, free it (and never keep a stale copy).
            self.net.reshard()
        return out

    # -- training ----------------------------------------------------------------------

    def backward(self, samples: list[TrainSample]) -> LossStats:
        """Zero the gradients and accumulate the gradient of the global token-mean loss
        over this rank's samples (reduced over ranks). No optimizer step."""
        validate_samples(samples, self.vocab_size)
        rows = self._rows(samples)
        local_tokens = float(sum(s.num_loss_tokens for s in samples))
        total_tokens = float(self.dp.all_reduce(torch.tensor([local_tokens], dtype=torch.float64))[0])
        if total_tokens == 0:
            raise ValueError("the batch has no sampled (mask 1) tokens to train on")
        # Every rank runs as many forward passes as the busiest one (collectives in FSDP
        # forward/backward must line up); a spare pass contributes a zero loss.
        max_rows = int(self.dp.all_reduce(torch.tensor([float(len(rows))]), op="max")[0])
        self.optimizer.zero_grad(set_to_none=False)
        stats = LossStats()
        for r in range(max_rows):
            if r < len(rows):
                pack = build_pack(samples, rows[r])
            else:
                pack = build_pack([TrainSample([0], [0], [0.0], [1], 0.0)], [0])
                pack.loss_mask.zero_()
            new = self.pack_logprobs(pack)
            loss, st = policy_loss(
                new,
                pack.old_logprobs.to(self.device),
                pack.advantages.to(self.device),
                pack.loss_mask.to(self.device),
                self.cfg.loss,
                denominator=total_tokens,
            )
            (loss * self.dp.loss_scale).backward()
            stats.add(st)
        self.dp.reduce_gradients(self.params)
        return self._reduce_stats(stats)

    def _reduce_stats(self, stats: LossStats) -> LossStats:
        if self.dp.world_size == 1:
            return stats
        t = stats.as_tensor()
        is_max = torch.tensor(LossStats.max_fields())
        summed = self.dp.all_reduce(torch.where(is_max, torch.zeros_like(t), t))
        maxed = self.dp.all_reduce(torch.where(is_max, t, torch.zeros_like(t)), op="max")
        return LossStats.from_tensor(torch.where(is_max, maxed, summed))

    def current_lr(self) -> float:
        """LR of the next optimizer step (1-based step count, linear warmup)."""
        if self.cfg.warmup_steps <= 0:
            return self.cfg.lr
        return self.cfg.lr * min(1.0, (self.step + 1) / self.cfg.warmup_steps)

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Exactly one AdamW step on `samples`; returns the step's metrics."""
        t0 = time.perf_counter()
        stats = self.backward(samples)
        grad_norm = self.dp.clip_grad_norm(self.params, self.cfg.max_grad_norm)
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        seconds = time.perf_counter() - t0
        tokens = self.dp.all_reduce(torch.tensor([float(sum(len(s) for s in samples))]))[0].item()
        metrics = stats.summarize(self.cfg.loss.loss_fn)
        metrics.update(
            {
                "optim/grad_norm": float(grad_norm),
                "lr": lr,
                "training_step": float(self.step),
                "time/training": seconds,
                "learner/tokens": tokens,
                "learner_tokens_per_second_step": tokens / max(seconds, 1e-9),
            }
        )
        return metrics

    # -- weights and checkpoints -------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """HF-named tensors for the inference engine (optionally cast, e.g. to the engine's
        bf16); the tied LM head is left out. Under FSDP a collective: every rank calls it,
        rank 0 gets the full tensors and the others an empty dict."""
        state = self.dp.full_state_dict(self.model)
        return {
            k: (v.detach() if dtype is None else v.detach().to(dtype))
            for k, v in state.items()
            if not (self.tied and k == "lm_head.weight")
        }

    def save(self, path: str | Path, step: int | None = None, extra: dict | None = None) -> Path:
        """HF model (safetensors + config + tokenizer + chat template) and trainer state.
        Every rank calls it (gathering is a collective under FSDP); rank 0 writes."""
        return ckpt.save_checkpoint(
            path,
            self.model,
            optimizer_state=self.dp.optimizer_state(self.optimizer),
            step=self.step if step is None else step,
            extra=extra or {},
            tokenizer_dir=self.model_dir,
            state_dict=self.dp.full_state_dict(self.model),
            write=self.dp.rank == 0,
        )

    @classmethod
    def load(cls, path: str | Path, cfg: LearnerConfig | None = None, dp: DataParallel | None = None) -> "Learner":
        """Resume from a checkpoint written by `save`: weights, optimizer, step, RNG, extra.
        Any strategy and world size resumes any checkpoint (the state on disk is full)."""
        learner = cls(path, cfg, dp)
        state = ckpt.load_trainer_state(path)
        learner.dp.load_optimizer_state(learner.optimizer, state["optimizer"])
        learner.step = int(state["step"])
        learner.extra = state.get("extra", {})
        ckpt.restore_rng(state["rng"])
        return learner
