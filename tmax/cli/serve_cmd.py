"""`tmax serve [MODEL]`: start vLLM's OpenAI-compatible server with the paper's flags.

The command line comes from `training.inference.serving` (the same server the trainer runs), so a
checkpoint written by `tmax learn` is served exactly as it was sampled during training.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import List, Optional

import typer

from tmax.cli.exits import fail
from tmax.cli.missing_extra import require
from tmax.training.inference.serving import DEFAULT_MODEL


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    ctx: typer.Context,
    model: str = typer.Argument(
        DEFAULT_MODEL, help="HF model name or a local model dir (e.g. a tmax learn checkpoint; a LoRA checkpoint serves on its base)."),
    lora: Optional[str] = typer.Option(
        None, "--lora", help="A LoRA adapter dir (PEFT format, e.g. a tmax learn LoRA checkpoint) served on MODEL under its own name."),
    port: int = typer.Option(8000, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (0.0.0.0 to serve other machines)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model name clients send (default: MODEL or the dir name)."),
    tool_call_parser: Optional[str] = typer.Option(
        None, help="vLLM tool-call parser (default: qwen3_xml; hermes for JSON <tool_call> templates such as the nano model)."
    ),
    max_model_len: Optional[int] = typer.Option(None, help="Context length (default 65536, capped at the model's positions)."),
    max_logprobs: Optional[int] = typer.Option(None, help="Most logprobs a request may ask for (default 20)."),
    tensor_parallel_size: Optional[int] = typer.Option(None, help="GPUs to shard over (default: all visible GPUs)."),
    data_parallel_size: Optional[int] = typer.Option(None, help="GPU only: model replicas (default: vLLM's, 1)."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, help="GPU only: share of each GPU's memory vLLM may take (default: vLLM's, 0.9)."
    ),
    device: Optional[str] = typer.Option(None, help="auto | cpu | gpu (default auto: gpu when one is visible)."),
    dtype: Optional[str] = typer.Option(None, help="Weights dtype (default auto: float32 for tiny models on CPU)."),
    kv_cache_gb: Optional[float] = typer.Option(None, help="CPU only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE; default 1)."),
    cpu_threads: Optional[int] = typer.Option(
        None, help="CPU only: the engine's torch threads (OMP_NUM_THREADS; default: vLLM's choice, every core)."
    ),
    enforce_eager: Optional[bool] = typer.Option(
        None, "--enforce-eager/--no-enforce-eager", help="Skip CUDA graphs / torch.compile (default: on for CPU)."
    ),
    enable_prefix_caching: Optional[bool] = typer.Option(
        None, "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV of shared prompt prefixes (default: vLLM's, on where the model supports it)."
    ),
    dev: bool = typer.Option(False, "--dev", help="Training setup: dev endpoints and the weight-push worker extension."),
    extra_args: Optional[List[str]] = typer.Option(None, "--vllm-arg", help="Extra argument passed to vLLM verbatim (repeatable)."),
    log: Optional[Path] = typer.Option(None, help="Server log file (default: ~/.cache/tmax/serve/<name>-<port>.log)."),
    startup_timeout: float = typer.Option(1800.0, help="Seconds to wait for the server to become healthy."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and exit."),
) -> None:
    """Serve a model with vLLM's OpenAI-compatible API; prints the base URL when ready."""
    from pydantic import ValidationError
    from rich.console import Console

    from tmax.common.errors import validation_message
    from tmax.training.inference.serving import ServerError, ServeSpec, VLLMServer, build_command

    console = Console(stderr=True)
    # The flags are named as the server options (`training.engine_options`); one left out
    # keeps the option's default.
    given = {k: v for k, v in ctx.params.items() if k in ServeSpec.model_fields and v is not None}
    try:
        spec = ServeSpec(**given)
    except ValidationError as e:
        fail(validation_message(e), 2)
    try:
        cmd = build_command(spec)
    except (ValueError, ServerError) as e:
        fail(str(e), 2)
    if dry_run:
        for note in cmd.notes:
            console.print(f"[dim]note: {note}[/dim]")
        typer.echo(cmd.shell())
        return
    require("tmax serve", "vllm")

    name = cmd.served_model_name
    log_path = log or Path.home() / ".cache" / "tmax" / "serve" / f"{name.replace('/', '_')}-{port}.log"
    server = VLLMServer(spec, log_path=log_path)
    for note in cmd.notes:
        console.print(f"[dim]note: {note}[/dim]")
    console.print(f"[dim]$ {cmd.shell()}[/dim]")
    # SIGTERM (e.g. from a process manager) takes the same clean path as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start()
        t0 = time.monotonic()
        with console.status(f"starting vLLM (log: {log_path})"):
            server.wait_healthy(startup_timeout)
        console.print(f"[green]ready[/green] in {time.monotonic() - t0:.0f} s: model [bold]{server.served_model_name}[/bold]")
        # The one line on stdout: what to pass as --base-url / OPENAI_BASE_URL.
        typer.echo(server.base_url, err=False)
        console.print("Ctrl-C stops the server.")
        while server.alive():
            time.sleep(1.0)
        console.print(f"[red]vLLM exited[/red]; log {log_path}:\n{server.log_tail()}")
        raise typer.Exit(1)
    except ServerError as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        console.print("stopping vLLM ...")
    finally:
        server.stop()
