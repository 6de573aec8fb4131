"""LoRA in the learner, through PEFT: an adapter on the frozen base model.

`LoraSpec` is the `[lora]` section as the learner takes it. `attach` puts an adapter on a
loaded HF model, in place (the model object stays the one the learner runs, its LoRA layers
injected): a new one for `spec`, or the adapter of a checkpoint, trainable. Only the
adapter's parameters require grad, so only they reach the optimizer; the packed forward,
the prefix-trie attention, the fp32 LM head and every loss run unchanged.

A LoRA checkpoint is a PEFT adapter directory (`adapter_config.json`, whose
`base_model_name_or_path` is the base model's absolute path, and `adapter_model.safetensors`)
plus the tokenizer files and the trainer state (`checkpoint.py`): what `tmax serve` serves on
top of its base, and what `merge` turns into full HF weights.

Names: the learner's model is `PeftModel.base_model.model`; its state dict has keys such as
`model.layers.0.self_attn.q_proj.lora_A.default.weight`. PEFT's functions take the
`PeftModel`'s keys (`base_model.model.` in front), and the saved adapter drops the adapter
name (`...q_proj.lora_A.weight`): `adapter_tensors` gives those, the names engines load.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tmax.common.files import write_dir_atomic
from tmax.training.weights.adapter import ADAPTER_WEIGHTS, AdapterError, adapter_base, adapter_config, is_adapter_dir

if TYPE_CHECKING:
    import peft

    from tmax.training.config import LoraConfig as LoraSection
    import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.target_modules:
            raise ValueError("LoRA needs at least one target module")

    @classmethod
    def of(cls, section: LoraSection) -> "LoraSpec | None":
        """The learner's spec of a `[lora]` section (`training.config.LoraConfig`); None when off."""
        if not section.rank:
            return None
        return cls(section.rank, section.alpha, section.dropout, tuple(section.target_modules))

    def peft_config(self, base_dir: str | Path) -> peft.LoraConfig:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), task_type="CAUSAL_LM",
                          base_model_name_or_path=str(Path(base_dir).resolve()))


def learner_dtype(section: LoraSection, engine_dtype: str) -> str:
    """The dtype a learner holds its model in: fp32 master weights for full fine-tuning; with
    `[lora]` on (`section`), the frozen base in the dtype the engine serves it in (bf16 / fp16,
    else fp32), the adapter in fp32 (PEFT's autocast)."""
    return engine_dtype if section.enabled and engine_dtype in ("bfloat16", "float16") else "float32"


def start_dirs(model_dir: str | Path) -> tuple[Path, Path | None]:
    """(the base model directory, the adapter directory or None) of where a learner starts."""
    if is_adapter_dir(model_dir):
        return adapter_base(model_dir), Path(model_dir).resolve()
    return Path(model_dir), None


def run_start(section: LoraSection, model_dir: str | Path, run_dir: str | Path, seed: int) -> str:
    """Where a run's learner and engines start: `model_dir`, or, with `[lora]` on
    (`section`, a `training.config.LoraConfig`) and a full model there, a new adapter for it
    in `run_dir/adapter-init`. An adapter checkpoint continues as it is (its rank must be
    lora.rank's when that is set)."""
    spec = LoraSpec.of(section)
    if is_adapter_dir(model_dir):
        rank = int(adapter_config(model_dir)["r"])
        if spec is not None and spec.rank != rank:
            raise AdapterError(f"{model_dir} is a rank-{rank} adapter; lora.rank {spec.rank} asks for another "
                               "(continue it without --lora-rank, or start a new one from its base)")
        return str(model_dir)
    if spec is None:
        return str(model_dir)
    return str(init_adapter(model_dir, spec, Path(run_dir) / "adapter-init", seed))


def attach(model: "torch.nn.Module", spec: LoraSpec | None, adapter_dir: Path | None, base_dir: Path) -> torch.nn.Module:
    """Inject a trainable adapter into `model` in place and return the `PeftModel`: the one
    in `adapter_dir` (whose rank must match `spec` when both are given), else a new one of
    `spec` (PEFT's initialisation: A random, B zero, so the model starts as the base)."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        rank = int(adapter_config(adapter_dir)["r"])
        if spec is not None and spec.rank != rank:
            raise AdapterError(f"{adapter_dir} is a rank-{rank} adapter, not rank {spec.rank}")
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    if spec is None:
        raise ValueError("attach needs a LoRA spec or an adapter directory")
    return get_peft_model(model, spec.peft_config(base_dir))


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_tensors(peft_model: peft.PeftModel, state: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """The adapter's tensors under the names `adapter_model.safetensors` uses, from the
    learner model's (full) state dict `state`."""
    from peft import get_peft_model_state_dict

    ours = {PEFT_PREFIX + k: v for k, v in state.items() if is_adapter_key(k)}
    return get_peft_model_state_dict(peft_model, state_dict=ours)


def peft_state(state: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """The adapter entries of the learner model's state dict, under the `PeftModel`'s keys
    (what `PeftModel.save_pretrained(state_dict=...)` takes)."""
    return {PEFT_PREFIX + k: v for k, v in state.items() if is_adapter_key(k)}


def learner_state(adapter_dir: str | Path) -> dict[str, "torch.Tensor"]:
    """A saved adapter's tensors under the learner model's state-dict keys (to load in place)."""
    from safetensors.torch import load_file

    out = {}
    for k, v in load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS)).items():
        inner = k.removeprefix(PEFT_PREFIX)
        for part in (".lora_A.", ".lora_B."):
            inner = inner.replace(part, f"{part}{ADAPTER_NAME}.")
        out[inner] = v
    return out


def init_adapter(model_dir: str | Path, spec: LoraSpec, out: str | Path, seed: int) -> Path:
    """A new adapter of `spec` for the base `model_dir`, written as directory `out` with the
    base's tokenizer files, without loading the base's weights (the model is built on the
    meta device; only the adapter's tensors are made): where a LoRA run's learner and
    engines both start. PEFT's initialisation, seeded: A Kaiming-uniform, B zero."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = Path(model_dir).resolve()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base)))
    peft_model = attach(model, spec, None, base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if name.endswith((".lora_A", ".lora_B")):
                layer = module[ADAPTER_NAME].to_empty(device="cpu")
                if name.endswith(".lora_A"):
                    # torch's nn.Linear default, PEFT's default for A: kaiming_uniform_(a=sqrt(5))
                    bound = 1.0 / math.sqrt(layer.weight.shape[1])
                    layer.weight.copy_(torch.rand(layer.weight.shape, generator=gen) * 2 * bound - bound)
                else:
                    layer.weight.zero_()

    def make(tmp: Path) -> Path:
        peft_model.save_pretrained(str(tmp), state_dict=peft_state(peft_model.base_model.model.state_dict()))
        _copy_tokenizer(base, tmp)
        return Path(out)

    return write_dir_atomic(Path(out), make)


def _copy_tokenizer(src: Path, dest: Path) -> None:
    from tmax.training.learner.checkpoint import TOKENIZER_FILES

    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)


def merge(adapter_dir: str | Path, out: str | Path) -> Path:
    """Full Hugging Face weights of base + adapter (`tmax learn merge`), in the base's
    dtype, with the adapter checkpoint's tokenizer files: a model directory any HF or vLLM
    loader serves without LoRA. Written beside `out` and renamed into place."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = Path(adapter_dir).resolve()
    base = adapter_base(adapter)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()

    def make(tmp: Path) -> Path:
        with torch.no_grad():
            merged.save_pretrained(str(tmp))
        _copy_tokenizer(base, tmp)
        _copy_tokenizer(adapter, tmp)
        return Path(out)

    return write_dir_atomic(Path(out), make)
