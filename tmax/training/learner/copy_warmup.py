"""Copy pre-training: teach a random-init model to copy before SFT (`sft.copy_steps`).

A model built from random weights has no way to write a value it read a few lines up: it
has to grow one (induction heads: one head marks each token's predecessor, another finds the
earlier place where the current token stood and copies what followed it). On the
long-horizon tasks SFT alone does not grow it: the copied tokens are a few of every
demonstration's hundred, and 320 steps of them left every value-copying turn wrong
(docs/results/notebook.md, "Preset nano-long"). Here the model trains on short sequences
where half the tokens are copies,

    words: W1 W2 W3 W4
    again: W1 W2 W3 W4

with words drawn from the train split's values (so no held-out value is seen) and the loss on
every token: the copy forms in a sudden drop of the loss after a few hundred steps, and then
copies words of any pool made of the same pieces. It runs through the same learner and
loss as SFT (`learner.sft.sft_loss`): one sequence is one sample whose tokens after the
first are all targets.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from tmax.training.learner.packing import TrainSample

if TYPE_CHECKING:
    from tmax.training.config import LearnConfig

COPY_HEAD = "words:"
COPY_AGAIN = "\nagain:"


@dataclass
class CopyResult:
    checkpoint: str
    steps: int
    final_loss: float | None
    repeat_nll: float  # mean loss on the repeated words of fresh sequences, after training
    seconds: float


def copy_sequence(tok, words: Sequence[str]) -> tuple[list[int], int]:
    """`words: W1 ... Wk` then `again: W1 ... Wk` as token ids, and where the repeat starts.
    Every word follows a space, as values do in the tasks' files and commands."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    body = enc("".join(" " + w for w in words))
    first = enc(COPY_HEAD) + body + enc(COPY_AGAIN)
    return first + body, len(first)


def copy_samples(tok, pool: Sequence[str], n: int, words: int, rng: random.Random,
                 repeat_only: bool = False) -> list[TrainSample]:
    """`n` sequences of `words` words drawn from `pool`, each a sample whose loss tokens are
    every token after the first (or, `repeat_only`, the repeated words alone)."""
    from tmax.agents.policy import TokenTrace

    out = []
    for _ in range(n):
        ids, repeat = copy_sequence(tok, [rng.choice(pool) for _ in range(words)])
        mask = [int(not repeat_only or i >= repeat) for i in range(1, len(ids))]
        out.append(TrainSample(TokenTrace(ids[:1], ids[1:], [0.0] * (len(ids) - 1), mask), 1.0))
    return out


def repeat_nll(learner, samples: list[TrainSample]) -> float:
    """Mean loss (nats) on the repeated words of `repeat_only` samples: about ln 70 = 4.2 for
    a syllable at chance, near 0 once the model copies."""
    lps = learner.logprobs(samples)
    picked = [-lp for s, row in zip(samples, lps) for lp, m in zip(row, s.trace.mask) if m]
    return sum(picked) / max(1, len(picked))


def train_copy(model_dir: str, pool: Sequence[str], cfg: LearnConfig, out_dir: str | Path,
               log: Callable[[int, int, float], None] | None = None) -> CopyResult:
    """`sft.copy_steps` AdamW steps of `sft.copy_batch_size` copy sequences (`copy_samples`)
    from `model_dir` through the SFT loss; writes an HF checkpoint to `out_dir`."""
    import torch
    from transformers import AutoTokenizer

    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.sft import THREAD_CHECK_STEPS, CoreShare, final_loss, sft_loss

    t0 = time.monotonic()
    s = cfg.sft
    tok = AutoTokenizer.from_pretrained(model_dir)
    # beta2 0.95 (language-model pretraining's): Adam's second moment follows the loss's sudden
    # drop within some 20 steps instead of 1,000.
    learner = Learner(model_dir, LearnerConfig(
        lr=s.copy_lr, betas=(0.9, 0.95), warmup_steps=max(1, int(s.copy_steps * s.warmup_ratio)),
        max_grad_norm=cfg.algo.grad_clip, pack_length=4096, seed=cfg.algo.seed))
    rng = random.Random(f"copy-{cfg.algo.seed}")
    losses: list[float] = []
    share = CoreShare()
    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    for step in range(s.copy_steps):
        if not s.torch_threads and step % THREAD_CHECK_STEPS == 0:
            torch.set_num_threads(share.free_cores())  # as SFT does (`learner.sft.CoreShare`)
        metrics = learner.train_step(copy_samples(tok, pool, s.copy_batch_size, s.copy_words, rng), loss_fn=sft_loss)
        losses.append(metrics["loss/policy_avg"])
        if log is not None:
            log(step + 1, s.copy_steps, losses[-1])
    check = copy_samples(tok, pool, 64, s.copy_words, random.Random(f"copy-check-{cfg.algo.seed}"), repeat_only=True)
    nll = repeat_nll(learner, check)
    path = learner.export(out_dir)
    return CopyResult(str(path), s.copy_steps, final_loss(losses), nll, time.monotonic() - t0)
