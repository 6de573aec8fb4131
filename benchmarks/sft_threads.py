"""An SFT step of the nano recipe by torch threads: every core against one, and the count
`learner.sft.CoreShare` picks (what `train_sft` uses when `sft.torch_threads` is unset).

    python benchmarks/sft_threads.py --run runs/nano [--rounds 8] [--json]

Steps of the recipe's own SFT (its base model and `sft/demos.jsonl`, batch 8, the preset's
learner) in one process; rounds alternate the thread counts, so a machine whose load
changes loads each alike. Printed per count: the median wall seconds of a step, the mean
CPU seconds of a step (a thread waiting at a barrier spins: CPU above the work), and the
count CoreShare picked before each round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="a nano recipe directory (base/ and sft/demos.jsonl)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    import torch

    from tmax.training.config import preset
    from tmax.training.learner.learner import Learner
    from tmax.training.learner.sft import CoreShare, sft_loss, sft_samples
    from tmax.training.trainer import learner_config
    from tmax.training.rollout import Rollout

    cfg = preset("nano")
    demos = [Rollout.from_json(x) for x in (args.run / "sft" / "demos.jsonl").read_text().splitlines()]
    examples = sft_samples(demos)
    learner = Learner(args.run / "base", learner_config(cfg))
    rng = random.Random(0)
    cores = len(os.sched_getaffinity(0))
    share = CoreShare()
    learner.train_step(rng.sample(examples, cfg.sft.batch_size), loss_fn=sft_loss)  # warm-up
    wall: dict[int, list[float]] = {cores: [], 1: []}
    cpu: dict[int, list[float]] = {cores: [], 1: []}
    picked = []
    for _ in range(args.rounds):
        picked.append(share.free_cores())
        for threads in wall:
            torch.set_num_threads(threads)
            c, t = time.process_time(), time.perf_counter()
            learner.train_step(rng.sample(examples, cfg.sft.batch_size), loss_fn=sft_loss)
            wall[threads].append(time.perf_counter() - t)
            cpu[threads].append(time.process_time() - c)
    result = {"cores": cores, "load_avg_1m": round(os.getloadavg()[0], 2), "core_share_picked": picked,
              **{f"step_s_{n}_threads": round(statistics.median(v), 3) for n, v in wall.items()},
              **{f"cpu_s_{n}_threads": round(statistics.mean(v), 3) for n, v in cpu.items()}}
    record_result(args, result)
    if args.json:
        print(json.dumps(result))
        return
    for n in wall:
        print(f"{n} thread(s): {result[f'step_s_{n}_threads']} s a step (median), "
              f"{result[f'cpu_s_{n}_threads']} CPU s a step (mean)")
    print(f"CoreShare picked {picked}; load average {result['load_avg_1m']}")


if __name__ == "__main__":
    main()
