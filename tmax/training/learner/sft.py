"""The SFT warm start's training: cross-entropy on the assistant tokens of the
demonstrations it is given, through the RL learner.

A demonstration is any record holding a `TokenTrace` (`learner.packing.Traced`): the
teacher episodes of `training.demos`, or rated `tmax run --tokens` sessions
(`training.runs_data`). Loss on assistant tokens only (mask 1): a demonstration is a
`TrainSample` like any rollout, packed and run through the RL learner's forward, with a
cross-entropy loss in place of the policy loss. This module plays nothing and reads no
task: it trains on what it is given.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from tmax.common.records import SFT_RECORD, CheckpointExtra, SftRecord, write_record
from tmax.training.algo.batching import Group
from tmax.training.config import LearnConfig
from tmax.training.learner.packing import Pack, Traced, TrainSample, batch_samples

if TYPE_CHECKING:
    import torch

    from tmax.training.algo.dppo import LossStats


# How often (in steps) an SFT with no fixed thread count looks again at the cores it has.
THREAD_CHECK_STEPS = 16


@dataclass
class SFTResult:
    checkpoint: str
    demos: int
    tokens: int
    steps: int
    final_loss: float
    seconds: float
    steps_by_threads: dict[int, int] | None = None  # torch threads -> steps run with that many


class CoreShare:
    """How many of this process's cores other processes leave free, measured over the time
    since the last look: the machine's busy CPU seconds less this process's own, per
    second of wall. Torch's threads meet at a barrier after every operation, so with a
    thread more than the free cores each operation waits for the one that is descheduled:
    on this 2-core machine under load 6-7 an SFT step of the nano recipe took 8.6 s with 2
    threads against 1.8 s with 1 (quiet: 0.71 s against 1.32 s; docs/results/notebook.md,
    "SFT threads on a shared machine")."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._mark = self._now()

    def _now(self) -> tuple[float, float, float]:
        import psutil

        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        own = self._me.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    def free_cores(self, min_window_s: float = 1.0) -> int:
        """This process's cores less what the others used since the last call (their share
        of the machine's CPUs, spread evenly), at least 1. A look sooner than `min_window_s`
        after the last waits out the rest: a blip in a shorter window would decide."""
        import psutil

        time.sleep(max(0.0, self._mark[0] + min_window_s - time.monotonic()))
        (t0, busy0, own0), (t1, busy1, own1) = self._mark, self._now()
        self._mark = (t1, busy1, own1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-3)
        return max(1, min(cores, cores - round(others * cores / (psutil.cpu_count() or cores))))


def sft_loss(new: "torch.Tensor", pack: Pack, denominator: float) -> tuple["torch.Tensor", LossStats]:
    """Cross-entropy on the loss tokens of a pack (the assistant tokens), as a share of the
    batch's token mean: the `PackLoss` the learner takes instead of the policy loss."""
    from tmax.training.algo.dppo import LossStats

    nll = -(new.float() * pack.loss_mask).sum()
    tokens = float(pack.loss_mask.sum())
    return nll / denominator, LossStats(tokens=tokens, kept=tokens, loss_sum=float(nll.detach()))


def sft_samples(demos: Sequence[Traced]) -> list[TrainSample]:
    """Each demonstration's trace with advantage 1, whatever it scored (a teacher's failed
    demonstration is kept): its assistant tokens (mask 1) are the targets, through the same
    conversion as an RL batch."""
    group = Group("sft", [1.0] * len(demos), list(demos))
    return batch_samples([group], [[1.0] * len(demos)])


def train_sft(model_dir: str, demos: Sequence[Traced], cfg: LearnConfig, out_dir: str | Path,
              log: Callable[[int, int, float], None] | None = None, lora: bool = True) -> SFTResult:
    """Cross-entropy on assistant tokens through the RL learner (`Learner.train_step` with
    `sft_loss`: the same packing and forward); AdamW with warmup then constant LR; writes
    an HF checkpoint (weights + tokenizer + chat template) to `out_dir`, or with `[lora]` on
    (and `lora`) a LoRA adapter checkpoint (`model_dir` may be an adapter: trained further)."""
    import torch

    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.lora import LoraSpec

    examples = sft_samples(demos) if demos else []
    if not examples:
        raise ValueError("no demonstrations (with assistant tokens) to train on")
    t0 = time.monotonic()
    share = CoreShare()  # the first look covers loading the model below
    s = cfg.sft
    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    total = max(1, round(math.ceil(len(examples) / s.batch_size) * s.epochs))
    learner = Learner(model_dir, LearnerConfig(
        lr=s.lr, weight_decay=0.0, warmup_steps=max(1, int(total * s.warmup_ratio)),
        max_grad_norm=cfg.algo.grad_clip, pack_length=cfg.run.learner_pack_tokens or cfg.rollout.context_budget,
        seed=cfg.algo.seed, lora=LoraSpec.of(cfg.lora) if lora else None))
    rng = random.Random(cfg.algo.seed)
    order: list[int] = []
    losses: list[float] = []
    tokens = 0
    steps_by_threads: dict[int, int] = {}
    for step in range(total):
        if not s.torch_threads and step % THREAD_CHECK_STEPS == 0:
            # Every core while the machine is quiet; fewer while other processes keep some busy.
            torch.set_num_threads(share.free_cores())
        threads = torch.get_num_threads()
        steps_by_threads[threads] = steps_by_threads.get(threads, 0) + 1
        if len(order) < s.batch_size:
            more = list(range(len(examples)))
            rng.shuffle(more)
            order += more
        idx, order = order[: s.batch_size], order[s.batch_size:]
        metrics = learner.train_step([examples[i] for i in idx], loss_fn=sft_loss)
        losses.append(metrics["loss/policy_avg"])
        tokens += int(metrics["learner/loss_tokens"])
        if log is not None:
            log(step + 1, total, losses[-1])
    path = learner.export(out_dir, extra=CheckpointExtra(sft_steps=total, sft_demos=len(demos)))
    # The marker that SFT is done (the recipe skips SFT when it exists): written last, atomically.
    write_record(Path(path) / SFT_RECORD, SftRecord(steps=total, demos=len(demos), losses=losses,
                                                    steps_by_threads=steps_by_threads))
    return SFTResult(str(path), len(demos), tokens, total, final_loss(losses), time.monotonic() - t0,
                     steps_by_threads)


def final_loss(losses: Sequence[float]) -> float | None:
    """An SFT run's final loss: the mean of its last tenth of step losses (one step is noisy)."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail) if tail else None
