"""vLLM worker extension: load new weights into a running engine.

vLLM mixes this class into its worker (`--worker-extension-cls
training.vllm_ext.WeightPushExtension`); the dev-mode endpoint `POST /collective_rpc` calls
its methods in every worker. Only JSON strings cross that endpoint, so weights travel as a
safetensors file path (HF tensor names), written atomically by the trainer.

Why not `model.load_weights` directly: on CPU, linear layers pack their weight into a
oneDNN handle after loading and leave an empty `weight`, so a plain load fails half-way
and leaves a mixed model. The worker's own `reload_weights` restores the layout, loads,
and re-packs. It does not re-pack a tied LM head, whose handle is built from a copy of the
embedding; `_repack_cpu_gemm` does that (on GPU there is nothing to re-pack).

Imported inside vLLM worker processes; vllm is imported lazily so this module stays
importable (and testable for syntax) without it.
"""

from __future__ import annotations

import time


class WeightPushExtension:
    # Set by push_file; read by `policy_version` (the version of the weights now served).
    _tmax_policy_version: int = 0

    def push_file(self, path: str, version: str = "0") -> dict:
        """Load every tensor of the safetensors file at `path` into the model."""
        import torch
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = load_file(path, device="cpu")
        t_read = time.perf_counter() - t0
        # The worker's reload_weights runs under its vLLM config; call it through the
        # worker when it exists there, else through the model runner.
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights  # type: ignore[attr-defined]
        reload(weights_iterator=iter(state.items()))
        repacked = _repack_cpu_gemm(self.model_runner.model, torch)  # type: ignore[attr-defined]
        self._tmax_policy_version = int(version)
        return {
            "n_tensors": len(state),
            "repacked": repacked,
            "read_s": round(t_read, 4),
            "total_s": round(time.perf_counter() - t0, 4),
            "version": self._tmax_policy_version,
        }

    def policy_version(self) -> int:
        return int(self._tmax_policy_version)

    def weight_checksum(self) -> dict:
        """Sum of |w| per parameter: a cheap fingerprint to check that a push landed."""
        import torch

        out = {}
        with torch.no_grad():
            for name, p in self.model_runner.model.named_parameters():  # type: ignore[attr-defined]
                if p.numel():
                    out[name] = float(p.detach().float().abs().sum())
        return out


def _repack_cpu_gemm(model, torch) -> int:
    """Re-pack CPU GEMM handles of layers that keep their weight (the tied LM head)."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:  # a vLLM build without the CPU GEMM path
        return 0
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n
