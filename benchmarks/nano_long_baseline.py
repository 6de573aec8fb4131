"""The long-horizon nano tasks against a policy limited to one command, and the oracle.

Writes `--n` tasks of each split (`tasks.family = "long"`), then:

* one-command baseline: the share of tasks some single oracle command solves alone, with
  every value an observation revealed guessed from the split's pool (what a policy that
  never read an observation could write; `long_tasks.one_command_pass_rate`), per split;
* oracle: the oracle's turns played through the harness in a `--sandbox` sandbox and
  scored by the task's own verifier (`demos.play_demo`), held-out split;
* the tasks' depths (commands needed) and kinds.

    python benchmarks/nano_long_baseline.py [--n 200] [--seed 0] [--sandbox local] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="tasks per split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-e", "--env", "--sandbox", dest="sandbox", default="local", choices=["local", "bwrap", "podman"],
                    help="where the oracle's episodes run")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    from tmax.training.config import preset
    from tmax.training.demos import play_demo
    from tmax.training.nano.long_tasks import one_command_pass_rate
    from tmax.training.nano.model import build_tokenizer
    from tmax.common.records import NanoMeta
    from tmax.training.nano.tasks import oracle_steps, write_splits
    from tmax.training.rollout import EpisodeSettings, prepare_tasks

    out: dict = {"n_per_split": args.n, "seed": args.seed, "sandbox": args.sandbox}
    with tempfile.TemporaryDirectory(prefix="tmax-nano-long-") as tmp:
        splits = write_splits(Path(tmp) / "tasks", args.n, args.n, seed=args.seed, family="long")
        for split, dirs in splits.items():
            out[f"one_command_pass_rate_{split}"] = one_command_pass_rate(dirs, seed=args.seed)
        held = splits["heldout"]
        metas = [NanoMeta.read(d) for d in held]
        out["depths_heldout"] = dict(sorted(Counter(m.depth for m in metas).items()))
        out["kinds_heldout"] = dict(sorted(Counter(m.kind for m in metas).items()))
        cfg = preset("nano-long")
        cfg.rollout.sandbox = args.sandbox
        episode = EpisodeSettings.of(cfg.rollout)
        prepared = prepare_tasks(episode.env, [str(d) for d in held], log=lambda m: None)
        tok = build_tokenizer(args.seed, family="long")
        t0 = time.monotonic()
        rewards = [play_demo(d, oracle_steps(d), tok, episode, image=prepared.images.get(str(d))).reward for d in held]
        out["oracle_pass_rate_heldout"] = sum(rewards) / len(rewards)
        out["oracle_s_per_task"] = round((time.monotonic() - t0) / len(held), 3)
    record_result(args, out)
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
