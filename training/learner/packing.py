"""Token trajectories as the learner trains on them: `TrainSample` (one trajectory, its
sampler logprobs, loss mask and advantage), the token-balanced split over data-parallel
ranks, and packing several samples into one row (`Pack`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
