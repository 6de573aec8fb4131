"""Does copy pre-training teach the nano model to copy where an episode needs it? Its held-out check.

Builds the long family's nano model (seed `--seed`), runs the recipe's copy pre-training on it
(`learner.copy_warmup.train_copy`, the nano-long preset's `sft.copy_*` settings unless given
here; the preset has it off, so `--steps` is needed), then measures what it learned: held-out-pool values (never trained on) written as
`words: V1 V2 V3 V4`, then `--gap` tokens of the system prompt, then `again: V1 V2 V3 V4`,
the whole after `--prefix` tokens of the system prompt (an episode's values sit some 900
tokens in, tens to hundreds of tokens before they are copied). Reported per (prefix, gap):
the share of the repeat's tokens after its first value token that the model's argmax gets
right, teacher-forced. A model that copies scores near 1 everywhere; one that only copies a
repeat right after its line at the sequence's start scores there alone.

    python benchmarks/nano_copy_warmup.py [--steps 550] [--short 350] [--context 900] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

PREFIXES = (0, 300)
GAPS = (0, 100)


def copy_accuracy(model, tok, prefix: int, gap: int, n: int = 16, seed: int = 5) -> float:
    """Teacher-forced share of the repeat's tokens (after its first value token) the model
    gets right, held-out-pool values, after `prefix` and across `gap` system-prompt tokens."""
    import torch

    from tmax.agents import prompts
    from tmax.training.nano.tasks import value_pool

    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # Ten copies (~1,020 tokens): three (306) left a gap after a 300-token prefix 6 tokens long.
    filler = enc(prompts.SYSTEM_TEMPLATE * 10)
    rng = random.Random(seed)
    hit = total = 0
    for _ in range(n):
        body = enc("".join(" " + w for w in rng.sample(value_pool("heldout", "long"), 4)))
        ids = filler[:prefix] + enc("words:") + body + filler[prefix:prefix + gap] + enc("\nagain:") + body
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        for i in range(len(ids) - len(body) + 2, len(ids)):
            hit += pred[i - 1] == ids[i]
            total += 1
    return hit / max(1, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help="sft.copy_steps (default: the preset's)")
    ap.add_argument("--batch", type=int, help="sft.copy_batch_size")
    ap.add_argument("--words", type=int, help="sft.copy_words")
    ap.add_argument("--blocks", type=int, help="sft.copy_blocks")
    ap.add_argument("--short", type=int, help="sft.copy_short_steps")
    ap.add_argument("--lr", type=float, help="sft.copy_lr")
    ap.add_argument("--context", type=int, help="sft.copy_context")
    ap.add_argument("--threads", type=int, help="sft.torch_threads (default: the cores other processes leave free)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tmax.training.config import preset
    from tmax.training.learner.copy_warmup import train_copy
    from tmax.training.nano.model import build_nano_model
    from tmax.training.nano.tasks import value_pool

    given = {"copy_steps": args.steps, "copy_batch_size": args.batch, "copy_words": args.words,
             "copy_blocks": args.blocks, "copy_short_steps": args.short, "copy_lr": args.lr,
             "copy_context": args.context, "torch_threads": args.threads}
    cfg = preset("nano-long", {"sft": {k: v for k, v in given.items() if v is not None},
                               "algo": {"seed": args.seed}})
    if not cfg.sft.copy_steps:
        ap.error("the nano-long preset leaves copy pre-training off (sft.copy_steps = 0): give --steps")
    losses: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tmax-copy-") as tmp:
        build_nano_model(Path(tmp) / "base", seed=args.seed, family="long")
        t0 = time.monotonic()
        res = train_copy(str(Path(tmp) / "base"), value_pool("train", "long"), cfg, Path(tmp) / "copy",
                         log=lambda step, total, loss: losses.append(round(loss, 3)))
        seconds = time.monotonic() - t0
        tok = AutoTokenizer.from_pretrained(res.checkpoint)
        model = AutoModelForCausalLM.from_pretrained(res.checkpoint).eval()
        acc = {f"prefix {p}, gap {g}": round(copy_accuracy(model, tok, p, g), 3) for p in PREFIXES for g in GAPS}
    s = cfg.sft
    out = {"settings": {"steps": s.copy_steps, "batch": s.copy_batch_size, "words": s.copy_words,
                        "blocks": s.copy_blocks, "short_steps": s.copy_short_steps, "lr": s.copy_lr,
                        "context": s.copy_context, "seed": args.seed},
           "seconds": round(seconds, 1), "loss_every_50": losses[49::50], "repeat_nll": round(res.repeat_nll, 3),
           "heldout_copy_accuracy": acc}
    record_result(args, out)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
