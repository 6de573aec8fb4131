"""Copy pre-training: teach a random-init model to copy before SFT (`sft.copy_steps`).

A model built from random weights has no way to write a value it read a few lines up: it
has to grow one (induction heads: one head marks each token's predecessor, another finds the
earlier place where the current token stood and copies what followed it). On the
long-horizon tasks SFT alone does not grow it: the copied tokens are a few of every
demonstration's hundred, and 320 steps of them left every value-copying turn wrong
(docs/results/notebook.md, "Preset nano-long"). Here the model trains on short sequences
where many tokens are copies (`copy_sequence`),

    words: W1 W2 W3
    words: W4 W5 W6
    again: W1 W2 W3
    ...

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

COPY_NEW = "words:"
COPY_AGAIN = "again:"


@dataclass
class CopyResult:
    checkpoint: str
    steps: int
    final_loss: float | None
    repeat_nll: float  # mean loss on the copyable tokens of fresh sequences, after training
    seconds: float


def context_ids(tok) -> list[int]:
    """Prompt-like text copy sequences may sit in (`sft.copy_context`): the instance prompt
    twice, some 1,180 tokens. Not the system prompt, so the held-out check
    (benchmarks/nano_copy_warmup.py, whose prefix is system-prompt text) is text unseen here."""
    from tmax.agents import prompts

    return tok(prompts.INSTANCE_TEMPLATE * 2, add_special_tokens=False)["input_ids"]


def _slice(context: Sequence[int], longest: int, rng: random.Random) -> list[int]:
    n = rng.randint(0, min(longest, len(context)))
    start = rng.randint(0, len(context) - n)
    return list(context[start:start + n])


def copy_sequence(tok, pool: Sequence[str], words: int, blocks: int, rng: random.Random,
                  context: Sequence[int] = (), longest: int = 0) -> tuple[list[int], list[int], list[int]]:
    """`blocks` lines, each `words: W1 ... Wk` (k = `words` values new from `pool`) or, half
    the time once there is one, `again: W1 ... Wk` (an earlier line's values; at least one
    line is, so two lines are a line and its repeat), as token ids;
    which tokens a copy predicts (1): those of a repeated line after its first value
    token (which earlier line it repeats is a guess); and which are lines' tokens (1), not
    context. Repeats come 1 to `blocks` lines later, tens to hundreds of tokens apart and
    anywhere in the sequence, as values are in an episode: a copy learned from a repeat right
    after its line, at the sequence's start, did not copy across 50 tokens or after a
    300-token prefix (docs/results/notebook.md). With `longest`, the lines sit after a slice
    of 0 to `longest` tokens of `context` and 0 to `longest` // 16 of it between lines, as an
    episode's values sit hundreds of tokens into prompt text. Every value follows a space, as
    in the tasks' files and commands."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids: list[int] = []
    copyable: list[int] = []
    lines: list[int] = []
    seen: list[list[int]] = []
    for line in range(blocks):
        if longest:
            filler = _slice(context, longest if line == 0 else longest // 16, rng)
            ids += filler
            copyable += [0] * len(filler)
            lines += [0] * len(filler)
        # Half the lines after the first repeat one; the last does when none did before it.
        repeat = bool(seen) and (rng.random() < 0.5 or (line == blocks - 1 and len(seen) == blocks - 1))
        body = rng.choice(seen) if repeat else enc("".join(" " + rng.choice(pool) for _ in range(words)))
        if not repeat:
            seen.append(body)
        head = enc(("\n" if longest else "") + (COPY_AGAIN if repeat else COPY_NEW))
        ids += head + body + enc("\n")
        copyable += [0] * (len(head) + 2) + [int(repeat)] * (len(body) - 2) + [0]
        lines += [1] * (len(head) + len(body) + 1)
    return ids, copyable, lines


def copy_samples(tok, pool: Sequence[str], n: int, words: int, blocks: int, rng: random.Random,
                 repeat_only: bool = False, context: Sequence[int] = (), longest: int = 0) -> list[TrainSample]:
    """`n` sequences (`copy_sequence`), each a sample whose loss tokens are every line token
    after the first (context text has none), or, `repeat_only`, the copyable ones alone."""
    from tmax.agents.policy import TokenTrace

    out = []
    for _ in range(n):
        ids, copyable, lines = copy_sequence(tok, pool, words, blocks, rng, context, longest)
        mask = copyable[1:] if repeat_only else lines[1:]
        out.append(TrainSample(TokenTrace(ids[:1], ids[1:], [0.0] * (len(ids) - 1), mask), 1.0))
    return out


def repeat_nll(learner, samples: list[TrainSample]) -> float:
    """Mean loss (nats) on the copyable tokens of `repeat_only` samples: about ln 70 = 4.2 for
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
    context = context_ids(tok)
    share = CoreShare()
    if s.torch_threads:
        torch.set_num_threads(s.torch_threads)
    for step in range(s.copy_steps):
        if not s.torch_threads and step % THREAD_CHECK_STEPS == 0:
            torch.set_num_threads(share.free_cores())  # as SFT does (`learner.sft.CoreShare`)
        # First two-line sequences (a line, then it again), where the copy forms fastest; then
        # `copy_blocks` lines, where it learns to copy across distances. The same tokens a step.
        short = step < s.copy_short_steps
        n, blocks = (s.copy_batch_size * s.copy_blocks // 2, 2) if short else (s.copy_batch_size, s.copy_blocks)
        longest = 0 if short else s.copy_context  # in prompt text once the copy has formed
        batch = copy_samples(tok, pool, n, s.copy_words, blocks, rng, context=context, longest=longest)
        metrics = learner.train_step(batch, loss_fn=sft_loss)
        losses.append(metrics["loss/policy_avg"])
        if log is not None:
            log(step + 1, s.copy_steps, losses[-1])
    check = copy_samples(tok, pool, 32, s.copy_words, s.copy_blocks, random.Random(f"copy-check-{cfg.algo.seed}"),
                         repeat_only=True, context=context, longest=s.copy_context)
    nll = repeat_nll(learner, check)
    path = learner.export(out_dir)
    return CopyResult(str(path), s.copy_steps, final_loss(losses), nll, time.monotonic() - t0)
