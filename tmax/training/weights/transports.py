"""The names of `engine.weight_transport` and which one a run uses (no torch, no Ray)."""

from __future__ import annotations

from tmax.common.errors import ConfigError

DEFAULT_BUCKET_MB = 256  # the size of one broadcast (`engine.weight_bucket_mb`)

# `engine.weight_transport` values (see the package docstring); "auto" picks one.
TRANSPORTS = ("object_store", "gloo", "nccl")
GROUP_TRANSPORTS = ("gloo", "nccl")


def resolve_transport(choice: str, learner_on_cuda: bool, adapter: bool = False) -> str:
    """The transport a run uses for `engine.weight_transport` = `choice`; a LoRA run
    (`adapter`: only the adapter's tensors cross) uses the object store."""
    if adapter:
        if choice in GROUP_TRANSPORTS:
            raise ConfigError(f"engine.weight_transport = {choice} broadcasts full weights; a LoRA adapter syncs "
                              "through the object store (use auto or object_store)")
        return "object_store"
    if choice == "auto":
        return "nccl" if learner_on_cuda else "object_store"
    if choice == "nccl" and not learner_on_cuda:
        raise ConfigError("engine.weight_transport = nccl needs the learner on a CUDA GPU (use gloo or object_store)")
    if choice not in TRANSPORTS:
        raise ConfigError(f"unknown engine.weight_transport {choice!r}")
    return choice


def describe_transport(choice: str, learner_on_cuda: bool) -> str:
    """How the weights travel for `engine.weight_transport` = `choice`, in words (the plan
    printout; a choice that cannot run is said, not raised)."""
    try:
        transport = resolve_transport(choice, learner_on_cuda)
    except ConfigError as e:
        return f"impossible here: {e}"
    return {
        "object_store": "through the Ray object store (a safetensors file per engine)",
        "gloo": "by gloo broadcast through host memory",
        "nccl": "by NCCL broadcast GPU to GPU",
    }[transport]
