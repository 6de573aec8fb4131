"""Does a checkpoint copy what it read? Its greedy choice on the oracle's own long-horizon episodes.

The oracle's turns on `--n` tasks of each split are played through the harness (local
sandbox) and rendered as the policy sees them; one forward pass of `--model` over each
episode gives its argmax at every assistant token (teacher-forced: the context is always the
oracle's). A turn counts as right when every one of its tokens is the oracle's. Reported per
turn of the episode and per kind: a turn that writes a value an observation showed (`cat
NOTE`, `grep KEY`, `echo WORD`, `cd FOLDER`) is right only if the model copies it, the others
(the first read, `bash check.sh`, the submit) need no copying. Cheap (seconds) where a
held-out eval only says 0 %, and it says which turns fail and whether train tasks fail too.

    python benchmarks/nano_long_copy.py --model RUN/sft --tasks RUN/tasks [--n 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def right_turns(model, sample) -> list[bool]:
    """Per assistant turn of one rendered episode (a `TrainSample`): whether the model's argmax
    is the episode's token at every position of the turn."""
    import torch

    ids = sample.tokens
    mask = [0] * len(sample.trace.prompt_ids) + sample.trace.mask
    with torch.no_grad():
        pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
    turns: list[bool] = []
    right = True
    for i in range(1, len(ids)):
        if mask[i]:
            right &= pred[i - 1] == ids[i]
            if i + 1 == len(ids) or not mask[i + 1]:
                turns.append(right)
                right = True
    return turns


def split_report(model, tok, task_dirs: list[str]) -> dict:
    from tmax.training.config import preset
    from tmax.training.demos import collect_demos
    from tmax.training.learner.sft import sft_samples
    from tmax.common.records import NanoMeta

    oracle = preset("nano-long", {"sft": {"teacher_accuracy": 1.0}})
    by_turn: dict[int, list[bool]] = defaultdict(list)
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for d, sample in zip(task_dirs, sft_samples(collect_demos(task_dirs, tok, oracle))):
        turns = right_turns(model, sample)
        for i, ok in enumerate(turns):
            by_turn[i].append(ok)
        by_kind[NanoMeta.read(d).kind].append(all(turns))
    return {"episodes": len(task_dirs), "episodes_every_turn_right": sum(all_ok for v in by_kind.values() for all_ok in v),
            "turn_right": {str(k): f"{sum(v)}/{len(v)}" for k, v in sorted(by_turn.items())},
            "kind_every_turn_right": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_kind.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (a recipe run's sft or an RL step)")
    ap.add_argument("--tasks", required=True, help="the run's task directory (with train/ and heldout/)")
    ap.add_argument("--n", type=int, default=64, help="tasks per split (the first, by name)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    out: dict = {"model": args.model, "n_per_split": args.n}
    for split in ("heldout", "train"):
        dirs = sorted(str(p) for p in (Path(args.tasks) / split).iterdir())[: args.n]
        out[split] = split_report(model, tok, dirs)
    record_result(args, out)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
