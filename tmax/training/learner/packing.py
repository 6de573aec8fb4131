"""How a rollout turns into loss tokens, in one place.

* `TrainSample`: one token trajectory (the policy's `TokenTrace`, held as it is) and the
  sequence advantage it is trained with;
* `batch_samples`: the one conversion from finished groups and their advantages to samples
  (RL batches, rated `tmax run` sessions and SFT demonstrations all go through it);
* `shard`: the token-balanced split over data-parallel ranks;
* `pack_samples` / `build_pack`: several samples in one row (`Pack`) as the prefix trie of
  their tokens (training.algo.prefix_trie: a prefix they share is computed once), the loss
  positions and their targets.

torch is imported where tensors are built, so the training driver can import the
conversion without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from tmax.training.algo.prefix_trie import PrefixTrie, build_trie, pack_by_prefix

if TYPE_CHECKING:
    import torch

    from tmax.agents.policy import TokenTrace


class Traced(Protocol):
    """What samples are made from: a record holding the policy's token segments (`traces`:
    one `TokenTrace` for most episodes, one per context for a compacted one) — a rollout, a
    demonstration, a rated `tmax run` session."""

    @property
    def traces(self) -> list["TokenTrace"]: ...


@dataclass
class TrainSample:
    """`trace.prompt_ids` then `trace.ids`, where ids interleaves sampled tokens (mask 1,
    the sampler's logprob: the loss tokens) with observation / template tokens (mask 0)."""

    trace: "TokenTrace"
    advantage: float
    # A branching sample (`training.algo.tree`): (first index in `trace.ids`, advantage) of each
    # segment after the first, whose tokens take that advantage instead of `advantage`.
    later_segments: list[tuple[int, float]] = field(default_factory=list)
    # Tokens of `trace.ids` before this index are a sibling's to train (a prefix they share):
    # here they are context only.
    owned_from: int = 0

    def __len__(self) -> int:
        return len(self.trace.prompt_ids) + len(self.trace.ids)

    @property
    def tokens(self) -> list[int]:
        return [*self.trace.prompt_ids, *self.trace.ids]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.trace.mask[self.owned_from:])

    def token_advantages(self) -> list[float]:
        """The advantage of each token of `trace.ids` (its segment's)."""
        out = [self.advantage] * len(self.trace.ids)
        for start, a in self.later_segments:
            out[start:] = [a] * (len(out) - start)
        return out


class Branched(Protocol):
    """A branching group's item (`training.generator.Rollout`): where in its ids each fork was."""

    @property
    def branch_at(self) -> list[int]: ...


def batch_samples(groups: Sequence[Any], advantages: Sequence[Sequence[float | Sequence[float]]]) -> list[TrainSample]:
    """Samples of finished groups (`training.algo.batching.Group`, items `Traced`: one
    sample per token segment), each with its item's advantage: one number, or (a branching
    group, its items `Branched`) one per segment of the item's tree path, each segment's
    tokens trained once, in the first sample that holds them (`training.algo.tree`). A
    segment with no sampled token has nothing to train on and is left out."""
    from tmax.training.algo.tree import first_owner_depth

    out: list[TrainSample] = []
    for group, adv in zip(groups, advantages, strict=True):
        if len(group.items) != len(adv):
            raise ValueError(f"group {group.task_id!r}: {len(group.items)} items but {len(adv)} advantages")
        owners = first_owner_depth(group.paths) if group.paths is not None else [0] * len(adv)
        for item, a, owner in zip(group.items, adv, owners):
            if isinstance(a, (int, float)):
                out.extend(TrainSample(trace, float(a)) for trace in item.traces if trace.num_sampled)
            else:
                out.extend(_tree_sample(item, [float(x) for x in a], owner))
    return out


def _tree_sample(item: Any, segments: list[float], owner: int) -> list[TrainSample]:
    """One sample of a branching group's leaf: segment d (from fork d - 1 to fork d) takes
    `segments[d]`; tokens before the fork the leaf's owned segments start at are context."""
    starts = [0, *item.branch_at]
    if len(starts) != len(segments) or len(item.traces) != 1:
        raise ValueError(f"a leaf with {len(starts)} segments (one context) has {len(segments)} advantages")
    sample = TrainSample(item.trace, segments[0], list(zip(starts[1:], segments[1:])), owned_from=starts[owner])
    return [sample] if sample.num_loss_tokens else []


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


@dataclass
class Pack:
    """One packed row: the nodes of the prefix trie of its samples' tokens (`trie`), each
    distinct prefix once, position ids the nodes' depths. `pred_pos[j]` is the node whose
    hidden state predicts `targets[j]` (the parent of the target's node in its sample)."""

    input_ids: torch.Tensor  # [1, nodes]
    position_ids: torch.Tensor  # [1, nodes]
    pred_pos: torch.Tensor  # [n]
    targets: torch.Tensor  # [n]
    old_logprobs: torch.Tensor  # [n]
    advantages: torch.Tensor  # [n]
    loss_mask: torch.Tensor  # [n]
    spans: list[tuple[int, int, int]]  # (sample index, first response pred index in this pack, count)
    trie: PrefixTrie

    def to(self, device: "torch.device") -> "Pack":
        """The same row with its tensors on `device`."""
        moved = {k: v.to(device) for k, v in vars(self).items() if k not in ("spans", "trie")}
        return Pack(**moved, spans=self.spans, trie=self.trie)


def pack_samples(samples: list[TrainSample], pack_length: int) -> list[list[int]]:
    """Sample indices per row: samples sharing a prefix go together while the row's trie
    stays within `pack_length` nodes (`pack_by_prefix`); a sample longer than that gets a
    row of its own."""
    return pack_by_prefix([s.tokens for s in samples], pack_length)


def build_pack(samples: list[TrainSample], indices: list[int], all_positions: bool = False) -> Pack:
    """Tensors of one row. Targets are the mask-1 tokens, or with `all_positions` every
    response token (for diagnostics)."""
    import torch

    trie = build_trie([samples[i].tokens for i in indices])
    pred: list[int] = []
    tgt: list[int] = []
    old: list[float] = []
    adv: list[float] = []
    lmask: list[float] = []
    spans: list[tuple[int, int, int]] = []
    for path, i in zip(trie.paths, indices):
        t, token_adv, owned = samples[i].trace, samples[i].token_advantages(), samples[i].owned_from
        first, n_prompt = len(pred), len(t.prompt_ids)
        for k, (tok, lp, m, a) in enumerate(zip(t.ids, t.logprobs, t.mask, token_adv)):
            m = m if k >= owned else 0  # a sibling trains the prefix they share
            if not (m or all_positions):
                continue
            # The token at sequence position p is predicted by the node at p - 1 of its path.
            pred.append(path[n_prompt + k - 1])
            tgt.append(tok)
            old.append(lp if m else 0.0)
            adv.append(a if m else 0.0)
            lmask.append(float(m))
        spans.append((i, first, len(pred) - first))
    return Pack(
        input_ids=torch.tensor([trie.tokens], dtype=torch.long),
        position_ids=torch.tensor([trie.depths], dtype=torch.long),
        pred_pos=torch.tensor(pred, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        old_logprobs=torch.tensor(old, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        loss_mask=torch.tensor(lmask, dtype=torch.float32),
        spans=spans,
        trie=trie,
    )


def validate_samples(samples: list[TrainSample], vocab_size: int) -> None:
    for n, sample in enumerate(samples):
        where, s = f"train sample {n}", sample.trace
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
        if not all(math.isfinite(a) for a in (sample.advantage, *(a for _, a in sample.later_segments))):
            raise ValueError(f"{where}: advantage {sample.advantage} (segments {sample.later_segments}) is not finite")
