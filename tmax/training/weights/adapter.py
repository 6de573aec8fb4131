"""LoRA adapters on disk and in vLLM: what an adapter directory is, and how a server serves one.

An adapter directory is PEFT's format: `adapter_config.json` (rank, alpha, target modules,
and `base_model_name_or_path`, the base model it belongs to) and `adapter_model.safetensors`.
tmax's LoRA checkpoints are such directories plus the tokenizer files and the trainer state
(`training.learner.lora`), so `tmax serve`, a training engine and `tmax run --tokens` take one
wherever they take a model directory: the base comes from its config.

A server with an adapter (`training.inference.serving`) runs vLLM with LoRA on
(`--enable-lora`, one adapter slot, the rank rounded up to one vLLM supports) and registers
the adapter under its own name (`--lora-modules NAME=DIR`); the base stays listed under
another. A training engine keeps
the adapter's id and loads each step's adapter in place of it (`vllm_ext.push_adapter`):
only the adapter's tensors cross, as `adapter_model.safetensors` beside the start adapter's
config (`write_adapter`).

No torch at import: `tmax serve` builds its command line from files only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tmax.common.errors import ConfigError
from tmax.common.files import write_dir_atomic

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(ConfigError):
    """A directory that should be a LoRA adapter is not a usable one (bad input: the CLI
    exits 2 with the message)."""


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_config(path: str | Path) -> dict:
    p = Path(path).expanduser() / ADAPTER_CONFIG
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{p}: not a readable adapter config: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise AdapterError(f"{p}: not a LoRA adapter config (no rank `r`)")
    return cfg


def adapter_base(path: str | Path) -> Path:
    """The base model directory an adapter belongs to (`base_model_name_or_path`, relative
    to the adapter when relative); it must be a local model directory."""
    adapter = Path(path).expanduser().resolve()
    named = adapter_config(adapter).get("base_model_name_or_path")
    if not isinstance(named, str) or not named:
        raise AdapterError(f"{adapter}: its {ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    base = Path(named).expanduser()
    base = (base if base.is_absolute() else adapter / base).resolve()
    if not (base / "config.json").is_file():
        raise AdapterError(f"{adapter}: its base model {named} is not a model directory here (no config.json)")
    return base


def model_base(path: str | Path) -> Path:
    """The base model of a model or adapter directory: an adapter's base, else the directory."""
    return adapter_base(path) if is_adapter_dir(path) else Path(path).expanduser().resolve()


def copy_adapter(src: str | Path, dest: str | Path) -> Path:
    """The adapter files of `src` (config and weights) as directory `dest`, written whole."""
    def make(tmp: Path) -> Path:
        tmp.mkdir()
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(Path(src) / name, tmp / name)
        return Path(dest)

    return write_dir_atomic(Path(dest), make)


def write_adapter(dest: str | Path, config_text: str, tensors: dict[str, "torch.Tensor"]) -> Path:
    """An adapter directory `dest` of `tensors` (PEFT's saved names) and `config_text`
    (an `adapter_config.json`), written beside it and renamed into place: an engine never
    reads half an adapter."""
    import torch
    from safetensors.torch import save_file

    if not tensors:
        raise AdapterError("an adapter update with no tensors")

    def make(tmp: Path) -> Path:
        tmp.mkdir()
        (tmp / ADAPTER_CONFIG).write_text(config_text)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
                  str(tmp / ADAPTER_WEIGHTS))
        return Path(dest)

    return write_dir_atomic(Path(dest), make)


# Where an engine keeps the adapter its server starts with (a copy: the run may prune the
# checkpoint it came from, and a restarted engine starts from it again).
START_ADAPTER = "adapter-start"


def start_adapter(src: Path, work_dir: Path) -> Path:
    """The engine's start adapter: `src` copied into `work_dir`; a restarted engine whose
    `src` is gone (a pruned checkpoint) keeps the copy it made before."""
    dest = Path(work_dir) / START_ADAPTER
    if (Path(src) / ADAPTER_WEIGHTS).is_file():
        return copy_adapter(src, dest)
    if is_adapter_dir(dest):
        return dest
    raise AdapterError(f"{src}: no {ADAPTER_WEIGHTS} to serve")
