"""vLLM's OpenAI server for CPU, with its engine core forked instead of spawned.

    python training/inference/vllm_cpu_main.py --model DIR [vLLM server args ...]

Why: the API server starts its engine core as a child process. vLLM's CPU platform sets
the start method to `spawn` (`CpuPlatform.check_and_update_config`), so the child imports
torch, transformers and vLLM all over again before it loads a model of a few MB: about 10 of
a CPU start's 27 s on 2 cores (benchmarks/engine_start.py, `fork` against `spawn`). A fork
inherits the server's imports. Forking is safe here because the API server has run no
OpenMP parallel region before it starts the core (the core binds its own threads after the
fork), and the core is its only child: with `VLLM_ENABLE_V1_MULTIPROCESSING=0` the core runs
the model itself, no worker processes.

It runs by file path with whatever interpreter has vLLM, as `procguard.py` does; GPU
serving does not use it. `VLLM_WORKER_MULTIPROC_METHOD=spawn` in the environment keeps
vLLM's own choice.
"""

from __future__ import annotations

import os
import runpy
import sys

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _fork_engine_core() -> None:
    try:
        from vllm.platforms.cpu import CpuPlatform

        update = CpuPlatform.check_and_update_config.__func__
    except (ImportError, AttributeError):
        return  # a vLLM laid out otherwise keeps its own start method

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        os.environ[START_METHOD_ENV] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


if __name__ == "__main__":
    if os.environ.get(START_METHOD_ENV) != "spawn":
        _fork_engine_core()
    sys.argv[0] = SERVER_MODULE
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
