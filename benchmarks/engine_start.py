"""vLLM on CPU, its process layouts side by side: seconds from launch to healthy, and
sampling throughput of concurrent requests, on a nano model.

    python benchmarks/engine_start.py [--rounds 3] [--requests 16] [--tokens 128] [--json]

- `fork` (what `training.inference.serving` starts on CPU): the API server and one engine
  core, forked from it, that runs the model itself (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  vLLM's uniproc executor, as on a single GPU; the fork is `vllm_cpu_main.py`'s);
- `spawn`: the same two processes with vLLM's CPU start method, the engine core spawned: it
  imports torch, transformers and vLLM again before loading the model;
- `mp` (vLLM's CPU default): the API server, a spawned engine core, and a worker process
  that runs the model; one more process to start and a message queue between the
  scheduler and the model.

Rounds rotate the order of the layouts so that a noisy machine loads them alike; the ratios
are what to read. Each request samples `--tokens` tokens with EOS ignored, all sent at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

LAYOUTS = ("fork", "spawn", "mp")


def _serve(model: Path, layout: str, log: Path):
    from tmax.training.inference.serving import ServeSpec, VLLMServer
    from tmax.training.net import free_port

    server = VLLMServer(ServeSpec(model=str(model), port=free_port(), dev=True), log_path=log)
    if layout in ("spawn", "mp"):
        server.command.env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if layout == "mp":
        server.command.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    t0 = time.monotonic()
    server.start()
    server.wait_healthy()
    return server, time.monotonic() - t0


def _throughput(base_url: str, model: str, requests: int, tokens: int) -> float:
    import httpx

    body = {"model": model, "prompt": list(range(10, 74)), "max_tokens": tokens, "temperature": 1.0,
            "ignore_eos": True}

    def one(i: int) -> int:
        r = httpx.post(base_url + "/completions", json={**body, "seed": i}, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    one(0)  # warm
    t0 = time.monotonic()
    with ThreadPoolExecutor(requests) as ex:
        n = sum(ex.map(one, range(requests)))
    return n / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    from tmax.training.nano.model import build_nano_model

    res: dict[str, dict[str, list[float]]] = {k: {"start_s": [], "tokens_per_s": []} for k in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="tmax-engine-start-") as tmp:
        model = Path(tmp) / "nano"
        build_nano_model(model)
        for r in range(args.rounds):
            for layout in LAYOUTS[r % 3:] + LAYOUTS[:r % 3]:
                server, start_s = _serve(model, layout, Path(tmp) / f"{layout}-{r}.log")
                try:
                    tps = _throughput(server.base_url, server.served_model_name, args.requests, args.tokens)
                finally:
                    server.stop()
                res[layout]["start_s"].append(round(start_s, 1))
                res[layout]["tokens_per_s"].append(round(tps, 1))
                print(f"round {r} {layout}: start {start_s:.1f} s, {tps:.0f} tokens/s", file=sys.stderr)
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}
    out = {"rounds": res, "median": med,
           "start_spawn_over_fork": round(med["spawn"]["start_s"] / med["fork"]["start_s"], 2),
           "start_mp_over_fork": round(med["mp"]["start_s"] / med["fork"]["start_s"], 2),
           "throughput_fork_over_spawn": round(med["fork"]["tokens_per_s"] / med["spawn"]["tokens_per_s"], 2),
           "throughput_fork_over_mp": round(med["fork"]["tokens_per_s"] / med["mp"]["tokens_per_s"], 2)}
    record_result(args, out)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
