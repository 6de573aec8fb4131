"""The vLLM engine's CPU cost on a nano model, by its torch threads (`engine.cpu_threads`):
vLLM's default (every core) against one thread, under a rollout-like load; with
`--start-method`, the engine core forked (tmax's CPU launcher) against spawned (vLLM's CPU
default) instead.

    python benchmarks/engine_cpu.py [--model DIR] [--rounds 2] [--clients 8] [--episodes 48]
                                    [--start-method] [--json]

The load is what the nano RL run sends: `--clients` episodes at a time, each three turns of
up to 64 tokens at temperature 1, the first on the harness's real prompt (system prompt,
bash tool, a nano task's instruction: ~840 tokens), each next one on the previous prompt
plus the sampled turn and an observation. Printed per setting: sampled tokens per second
and the CPU seconds the server's processes (API server and engine core) spent per 1,000
tokens. Rounds alternate the settings, so a noisy machine loads both alike; the ratios
are what to read. A random-weights nano model (default) samples until the turn's limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

# name: (engine.cpu_threads, the engine core's start method: None is tmax's fork)
SETTINGS = {"vllm_default": (None, None), "one_thread": (1, None)}
START_METHODS = {"forked_core": (None, None), "spawned_core": (None, "spawn")}


def first_prompts(model: Path, n: int) -> list[list[int]]:
    """The first prompt of `n` nano train tasks, as the harness renders it."""
    from transformers import AutoTokenizer

    from tmax.agents import prompts
    from tmax.agents.tools import TOOLS
    from tmax.training.nano.tasks import generate

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for task in generate("train", n, seed=0):
        msgs = [prompts.system_message(), prompts.instance_message(task.instruction)]
        out.append(tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"])
    return out


def server_cpu_s(engine) -> float:
    import psutil

    root = psutil.Process(engine.server.proc.pid)
    return sum(p.cpu_times().user + p.cpu_times().system for p in [root, *root.children(recursive=True)])


def one_round(model: Path, setting: tuple[int | None, str | None], starts: list[list[int]], clients: int,
              work: Path) -> dict:
    from tmax.training.config import preset
    from tmax.training.inference.engine import VLLMEngine

    cpu_threads, start_method = setting
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    if start_method:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = start_method  # the server inherits it
    ecfg = preset("nano").engine.model_copy(update={"cpu_threads": cpu_threads})
    engine = VLLMEngine.from_config(ecfg, model, work_dir=work)
    try:
        sampler = engine.sampler()

        def episode(i: int) -> int:
            prompt, sampled = list(starts[i % len(starts)]), 0
            for turn in range(3):
                out = sampler.sample(prompt, 64, 1.0, 1.0, seed=10 * i + turn)
                sampled += len(out.ids)
                prompt += out.ids + prompt[-20:]  # the turn, then an observation-sized tail
            return sampled

        episode(0)  # warm
        cpu0, t0 = server_cpu_s(engine), time.monotonic()
        with ThreadPoolExecutor(clients) as ex:
            tokens = sum(ex.map(episode, range(len(starts))))
        wall, cpu = time.monotonic() - t0, server_cpu_s(engine) - cpu0
    finally:
        engine.close()
    return {"tokens_per_s": tokens / wall, "cpu_s_per_1k_tokens": 1000 * cpu / tokens, "server_cores": cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a nano checkpoint (default: a random-weights nano model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--start-method", action="store_true", help="compare the core forked against spawned")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    from tmax.training.nano.model import build_nano_model

    settings = START_METHODS if args.start_method else SETTINGS
    res: dict[str, list[dict]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory(prefix="tmax-engine-cpu-") as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "nano"
        if not args.model:
            build_nano_model(model)
        starts = first_prompts(model, args.episodes)
        for r in range(args.rounds):
            for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
                res[name].append(one_round(model, settings[name], starts, args.clients, Path(tmp) / f"{name}-{r}"))
    summary = {name: {k: round(statistics.median(x[k] for x in rows), 2) for k in rows[0]} for name, rows in res.items()}
    first, second = list(settings)
    a, b = summary[first], summary[second]
    summary["ratio_tokens_per_s"] = round(b["tokens_per_s"] / a["tokens_per_s"], 3)
    summary["ratio_cpu_per_token"] = round(b["cpu_s_per_1k_tokens"] / a["cpu_s_per_1k_tokens"], 3)
    record_result(args, summary)
    if args.json:
        print(json.dumps(summary))
        return
    for name in settings:
        s = summary[name]
        print(f"{name:<13} {s['tokens_per_s']:7.1f} tokens/s  {s['cpu_s_per_1k_tokens']:5.2f} CPU s per 1k tokens  "
              f"({s['server_cores']:.2f} cores busy)")
    print(f"{second} / {first}: tokens/s x{summary['ratio_tokens_per_s']}, CPU per token x{summary['ratio_cpu_per_token']}")


if __name__ == "__main__":
    main()
