"""The DPPO learner: HF transformers model + torch, one optimizer step per batch.

A `TrainSample` (training.learner.packing) is one trajectory as the sampler saw it, its
`TokenTrace`: `prompt_ids` then `ids`, where `ids` interleaves sampled tokens (mask 1, the
sampler's post-temperature logprob) with observation / template tokens (mask 0), and its
advantage. The learner packs several samples into one row as
the prefix trie of their tokens (training.learner.packing): the system prompt every sample
starts with, a group's task prompt and identical leading turns are computed once, each
node attending to its ancestors only (training.learner.trie_attention), so the loss and
gradients are those of one forward per sample. It runs the backbone over the row and
projects only the hidden states that predict a loss token through the LM head, in fp32,
chunk by chunk. Token t is predicted from position t - 1 of its sample, so the loss tokens
are exactly the sampled tokens. The loss is DPPO's policy loss,
or any `PackLoss` of the same shape (SFT's cross-entropy, training.learner.sft).

Data parallelism is behind `DataParallel`: the learner all-reduces the loss-token count
(global token-mean denominator), the number of packs (so every rank runs the same number of
forward passes, which FSDP's collectives need) and the statistics, and asks the backend to
reduce gradients. `DataParallel` itself is the single-process default. With several ranks
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

LoRA (`LearnerConfig.lora`, or a start directory that is an adapter checkpoint): PEFT
injects the adapter's layers into the same model object (`training.learner.lora`), so the
forward above is unchanged; only the adapter's parameters require grad, so only they are
in `params` and hold AdamW state. `named_weights` then gives the engines the adapter's
tensors only, and checkpoints are PEFT adapter directories that name their base model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tmax.common.records import CheckpointExtra
from tmax.training.algo.dppo import LossConfig, LossStats, policy_loss
from tmax.training.learner import checkpoint as ckpt
from tmax.agents.policy import TokenTrace
from tmax.training.learner import lora
from tmax.training.learner.lora import LoraSpec
from tmax.training.learner.packing import Pack, TrainSample, build_pack, pack_samples, validate_samples
from tmax.training.learner.parallel import STRATEGIES, DataParallel
from tmax.training.learner.trie_attention import TRIE_ATTENTION, TrieChains, no_mask, register

# A loss over one pack: (trainer logprobs of pack.targets, the pack on the learner's
# device, the global loss-token count) -> (loss to backpropagate, its statistics).
PackLoss = Callable[[torch.Tensor, Pack, float], "tuple[torch.Tensor, LossStats]"]


def _spare_pack() -> Pack:
    """A one-token row with no loss token: the forward a rank with nothing left runs so
    that its FSDP collectives line up with the busiest rank's."""
    pack = build_pack([TrainSample(TokenTrace([0], [0], [0.0], [1]), 0.0)], [0])
    pack.loss_mask.zero_()
    return pack


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
    pack_length: int = 67584  # max tokens a packed row computes (nodes of its samples' prefix trie)
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
    # same step as one process on both (tests/integration/test_learner_ranks.py), divides parameter and
    # optimizer memory by the world size, and CPU tests then run the GPU code path.
    strategy: str = "fsdp"
    loss: LossConfig = field(default_factory=LossConfig)
    # LoRA (training.learner.lora): train an adapter of this spec on the frozen base. A
    # learner that starts from an adapter checkpoint trains that adapter either way.
    lora: LoraSpec | None = None

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

    def forward(self, input_ids, position_ids, pred_pos, targets, chains):
        return self._fn(input_ids, position_ids, pred_pos, targets, chains)


class Learner:
    def __init__(self, model_dir: str | Path, cfg: LearnerConfig | None = None, dp: DataParallel | None = None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg or LearnerConfig()
        self.dp = dp or DataParallel()
        self.model_dir = Path(model_dir)
        base_dir, adapter_dir = lora.start_dirs(self.model_dir)
        if not (base_dir / "config.json").is_file():
            raise FileNotFoundError(f"no HF model at {base_dir} (config.json missing)")
        torch.manual_seed(self.cfg.seed)
        self.device = _resolve_device(self.cfg.device)
        register()
        dtype = getattr(torch, self.cfg.dtype)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype,
                                                              attn_implementation=TRIE_ATTENTION)
        except ValueError:  # a model class without pluggable attention: one row per sample
            self.model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
        # LoRA: the adapter's layers go into this same model object; only they require grad.
        self.peft = None
        if self.cfg.lora is not None or adapter_dir is not None:
            self.peft = lora.attach(self.model, self.cfg.lora, adapter_dir, base_dir)
        self.model.to(self.device)
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
        self.packing = self._trie_works()
        # Sharded (FSDP) before the optimizer exists, so AdamW's state is made per shard.
        self.net = self.dp.wrap(_LossForward(self.backbone, self.head, self._pack_logprobs))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay
        )
        self.step = 0
        self.extra = CheckpointExtra()
        self.timings: dict[str, float] = {}  # seconds of the last backward's forwards and backwards
        self.lr_scale = 1.0  # the collapse guard's remedy multiplies the LR schedule by this

    # -- forward -----------------------------------------------------------------------

    def _trie_works(self) -> bool:
        """Packing relies on every layer attending over the prefix trie (a linear-attention
        hybrid does not): check it once on random tokens, two sequences sharing a prefix,
        against each one alone, instead of trusting every architecture to."""
        from tmax.training.algo.prefix_trie import build_trie

        if self.model.config._attn_implementation != TRIE_ATTENTION:
            return False
        g = torch.Generator().manual_seed(0)
        a = torch.randint(0, self.vocab_size, (6,), generator=g).tolist()
        b = a[:4] + torch.randint(0, self.vocab_size, (3,), generator=g).tolist()
        trie = build_trie([a, b])
        dev = self.device
        with torch.no_grad():
            ids, pos = torch.tensor([trie.tokens], device=dev), torch.tensor([trie.depths], device=dev)
            try:
                packed = self._hidden(ids, pos, TrieChains.of(trie, dev))[0]
            except (TypeError, ValueError, KeyError):
                return False
            for seq, path in zip((a, b), trie.paths):
                alone = self._hidden(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None])[0]
                # Relative error: a few bf16 ulps when the trie is honoured, O(1) when not.
                err = (packed[path].float() - alone.float()).abs().mean()
                if not err <= 0.02 * alone.float().abs().mean():
                    return False
        return True

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                chains: TrieChains | None = None) -> torch.Tensor:
        """The backbone's last hidden states; with `chains`, over a prefix trie's nodes."""
        dtype = getattr(torch, self.cfg.autocast) if self.cfg.autocast else None
        trie = {} if chains is None else {"attention_mask": no_mask(self.model.config), "prefix_trie": chains}
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False, **trie)
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
        chains = TrieChains.of(pack.trie, dev) if self.packing else None
        return self.net(pack.input_ids.to(dev), pack.position_ids.to(dev), pack.pred_pos.to(dev),
                        pack.targets.to(dev), chains)

    def _pack_logprobs(self, input_ids, position_ids, pred_pos, targets, chains) -> torch.Tensor:
        hidden = self._hidden(input_ids, position_ids, chains)[0]
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
                self.pack_logprobs(_spare_pack())
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

    def rl_loss(self, new: torch.Tensor, pack: Pack, denominator: float) -> tuple[torch.Tensor, LossStats]:
        """DPPO (or GRPO) per `cfg.loss`: the RL loss of a pack."""
        return policy_loss(new, pack.old_logprobs, pack.advantages, pack.loss_mask, self.cfg.loss,
                           denominator=denominator)

    def backward(self, samples: list[TrainSample], loss_fn: PackLoss | None = None) -> LossStats:
        """Zero the gradients and accumulate the gradient of the global token-mean loss
        (`loss_fn`, the policy loss by default) over this rank's samples, reduced over
        ranks. No optimizer step."""
        return self._backward(samples, loss_fn)[0]

    def _backward(self, samples: list[TrainSample], loss_fn: PackLoss | None) -> tuple[LossStats, int]:
        """`backward`, and the number of tokens this rank's forwards computed; the seconds
        spent in forwards and backwards go to `self.timings`."""
        validate_samples(samples, self.vocab_size)
        loss_fn = loss_fn or self.rl_loss
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
        computed = 0
        forward_s = backward_s = 0.0
        for r in range(max_rows):
            t0 = time.perf_counter()
            pack = build_pack(samples, rows[r]) if r < len(rows) else _spare_pack()
            computed += len(pack.trie) if r < len(rows) else 0
            new = self.pack_logprobs(pack)
            loss, st = loss_fn(new, pack.to(self.device), total_tokens)
            t1 = time.perf_counter()
            (loss * self.dp.loss_scale).backward()
            forward_s, backward_s = forward_s + t1 - t0, backward_s + time.perf_counter() - t1
            stats.add(st)
        t2 = time.perf_counter()
        self.dp.reduce_gradients(self.params)
        self.timings = {"time/learner_forward": forward_s,
                        "time/learner_backward": backward_s + time.perf_counter() - t2}
        return self._reduce_stats(stats), computed

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
            return self.cfg.lr * self.lr_scale
        return self.cfg.lr * self.lr_scale * min(1.0, (self.step + 1) / self.cfg.warmup_steps)

    def train_step(self, samples: list[TrainSample], loss_fn: PackLoss | None = None) -> dict[str, float]:
        """Exactly one AdamW step on `samples` (`loss_fn` as in `backward`); returns the
        step's metrics."""
        t0 = time.perf_counter()
        stats, computed = self._backward(samples, loss_fn)
        t_opt = time.perf_counter()
        grad_norm = self.dp.clip_grad_norm(self.params, self.cfg.max_grad_norm)
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        seconds = time.perf_counter() - t0
        optimizer_s = time.perf_counter() - t_opt
        # Tokens of the samples, and tokens the forwards computed (each shared prefix once).
        tokens, computed = self.dp.all_reduce(torch.tensor([float(sum(len(s) for s in samples)), float(computed)])).tolist()
        metrics = stats.summarize(self.cfg.loss.loss_fn)
        metrics.update(
            {
                "optim/grad_norm": float(grad_norm),
                "lr": lr,
                "training_step": float(self.step),
                "time/training": seconds,
                **self.timings,
                "time/learner_optimizer": optimizer_s,
                "learner/tokens": tokens,
                "learner/tokens_computed": computed,
                "learner_tokens_per_second_step": tokens / max(seconds, 1e-9),
            }
        )
        return metrics

    # -- weights and checkpoints -------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """What the inference engines load after a step (optionally cast, e.g. to the engine's
        bf16): the HF-named weights, the tied LM head left out; with LoRA only the adapter's
        tensors, under the names of `adapter_model.safetensors`. Under FSDP a collective:
        every rank calls it, rank 0 gets the full tensors and the others an empty dict."""
        state = self.dp.full_state_dict(self.model)
        if self.peft is not None:
            state = lora.adapter_tensors(self.peft, state) if state else {}
        return {
            k: (v.detach() if dtype is None else v.detach().to(dtype))
            for k, v in state.items()
            if not (self.tied and k == "lm_head.weight")
        }

    def sync_nbytes(self) -> int:
        """Bytes of what `named_weights` hands the engines (no gathering: the full shapes)."""
        keep = lora.is_adapter_key if self.peft is not None else (lambda k: not (self.tied and k == "lm_head.weight"))
        return sum(v.numel() * v.element_size() for k, v in self.model.state_dict().items() if keep(k))

    def save(self, path: str | Path, step: int | None = None, extra: CheckpointExtra | None = None) -> Path:
        """HF model (safetensors + config + tokenizer + chat template) and trainer state; with
        LoRA the adapter in PEFT's format (its config names the base model) instead of the
        model. Every rank calls it (gathering is a collective under FSDP); rank 0 writes."""
        optimizer_state = self.dp.optimizer_state(self.optimizer)
        return self._checkpoint(path, self.step if step is None else step, extra, optimizer_state)

    def export(self, path: str | Path, extra: CheckpointExtra | None = None) -> Path:
        """The weights alone, no optimizer (SFT's result): an HF model directory, or with
        LoRA the adapter's. Every rank calls it; rank 0 writes."""
        return self._checkpoint(path, 0, extra, None)

    def _checkpoint(self, path: str | Path, step: int, extra: CheckpointExtra | None,
                    optimizer_state: dict | None) -> Path:
        state = self.dp.full_state_dict(self.model)
        return ckpt.save_checkpoint(
            path,
            self.model if self.peft is None else self.peft,
            optimizer_state=optimizer_state,
            step=step,
            extra=extra,
            tokenizer_dir=self.model_dir,
            state_dict=state if self.peft is None else lora.peft_state(state),
            write=self.dp.rank == 0,
        )

    def restore(self, path: str | Path, lr_scale: float = 1.0) -> int:
        """Go back to checkpoint `path` in place: weights, optimizer, step, RNG (the
        collapse guard's rollback; the model and its shards stay where they are). Every
        rank calls it. Returns the checkpoint's step."""
        from transformers import AutoModelForCausalLM

        if self.peft is not None:  # the adapter only: the base never changed
            self.dp.load_full_state_dict(self.model, lora.learner_state(path), strict=False)
        else:
            src = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, self.cfg.dtype))
            self.dp.load_full_state_dict(self.model, src.state_dict())
        state = ckpt.load_trainer_state(path)
        self.dp.load_optimizer_state(self.optimizer, state["optimizer"])
        self.step = int(state["step"])
        self.extra = ckpt.checkpoint_meta(path).extra
        self.lr_scale = lr_scale
        ckpt.restore_rng(state["rng"])
        return self.step

    @classmethod
    def load(cls, path: str | Path, cfg: LearnerConfig | None = None, dp: DataParallel | None = None) -> "Learner":
        """Resume from a checkpoint written by `save`: weights, optimizer, step, RNG, extra.
        Any strategy and world size resumes any checkpoint (the state on disk is full)."""
        learner = cls(path, cfg, dp)
        state = ckpt.load_trainer_state(path)
        learner.dp.load_optimizer_state(learner.optimizer, state["optimizer"])
        learner.step = int(state["step"])
        learner.extra = ckpt.checkpoint_meta(path).extra
        ckpt.restore_rng(state["rng"])
        return learner
