"""vLLM worker extension: load new weights into a running engine.

vLLM mixes this class into its worker (`--worker-extension-cls
training.weights.vllm_ext.WeightPushExtension`); the dev-mode endpoint `POST /collective_rpc` calls
its methods in every worker. Only JSON strings cross that endpoint, so weights travel as a
safetensors file path (HF tensor names), written atomically by the trainer.

Why not `model.load_weights` directly: on CPU, linear layers pack their weight into a
oneDNN handle after loading and leave an empty `weight`, so a plain load fails half-way
and leaves a mixed model. The worker's own `reload_weights` restores the layout, loads,
and re-packs. It does not re-pack a tied LM head, whose handle is built from a copy of the
embedding; `_repack_cpu_gemm` does that (on GPU there is nothing to re-pack).

Process-group transport (`training.weights.group`): instead of a file, the weights can
arrive by broadcast from learner rank 0 over a standalone gloo / NCCL group. The worker
joins that group once (`join_weight_group`, its rank = the engine's rank offset + the
worker's tensor-parallel rank, so every TP shard holds a full copy of the stream and
loads its own slice), then every update is one `receive_weights` call carrying the
JSON manifest of the `WeightUpdate`; the call returns when the last bucket has arrived
and been loaded. The learner must broadcast at the same time: the call blocks.

Imported inside vLLM worker processes; vllm is imported lazily so this module stays
importable (and testable for syntax) without it.
"""

from __future__ import annotations

import time


class WeightPushExtension:
    # Set by push_file; read by `policy_version` (the version of the weights now served).
    _tmax_policy_version: int = 0

    # The weight group this worker joined (process-group transport), or None.
    _tmax_weight_group = None

    def push_file(self, path: str, version: str = "0") -> dict:
        """Load every tensor of the safetensors file at `path` into the model."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = load_file(path, device="cpu")
        t_read = time.perf_counter() - t0
        repacked = self._tmax_load(iter(state.items()), int(version))
        return {
            "n_tensors": len(state),
            "repacked": repacked,
            "read_s": round(t_read, 4),
            "total_s": round(time.perf_counter() - t0, 4),
            "version": self._tmax_policy_version,
        }

    def _tmax_load(self, pairs, version: int) -> int:
        import torch

        # The worker's reload_weights runs under its vLLM config; call it through the
        # worker when it exists there, else through the model runner.
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights  # type: ignore[attr-defined]
        reload(weights_iterator=pairs)
        repacked = _repack_cpu_gemm(self.model_runner.model, torch)  # type: ignore[attr-defined]
        self._tmax_policy_version = int(version)
        return repacked

    def push_adapter(self, path: str, version: str = "0") -> dict:
        """Load the LoRA adapter directory at `path` (PEFT format) in place of the one adapter
        this worker serves (its id unchanged, so requests naming it get the new weights)."""
        from safetensors import safe_open
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        ids = sorted(runner.list_loras())
        if len(ids) != 1:
            raise RuntimeError(f"push_adapter needs exactly one loaded adapter, the worker holds ids {ids}")
        with safe_open(f"{path}/adapter_model.safetensors", framework="pt") as f:
            n = len(list(f.keys()))
        runner.add_lora(LoRARequest(lora_name=f"tmax-{ids[0]}", lora_int_id=ids[0], lora_path=path,
                                    load_inplace=True))
        self._tmax_policy_version = int(version)
        return {"n_tensors": n, "adapter_id": ids[0], "total_s": round(time.perf_counter() - t0, 4),
                "version": self._tmax_policy_version}

    def join_weight_group(self, spec: str) -> dict:
        """Join the learner's weight group. `spec` is JSON: host, port (learner rank 0's
        TCPStore), rank_offset (this engine's first rank), world_size, backend
        ("gloo" | "nccl"), optional timeout_s. Blocks until every rank has joined."""
        from tmax.common.records import WeightGroupSpec
        from tmax.training.weights.group import WeightGroup

        s = WeightGroupSpec.model_validate_json(spec)
        rank = s.rank_offset + _tp_rank()
        # NCCL receives into this worker's GPU; gloo into host memory (then copied in).
        device = _worker_device(self) if s.backend == "nccl" else "cpu"
        self.leave_weight_group()
        self._tmax_weight_group = WeightGroup(s.host, s.port, rank, s.world_size, backend=s.backend, device=device,
                                              timeout_s=s.timeout_s)
        return {"rank": rank, "world_size": s.world_size, "backend": s.backend, "device": str(device)}

    def receive_weights(self, update: str) -> dict:
        """Receive one update (its `WeightUpdate` manifest, as JSON) by broadcast from
        rank 0 of the weight group, load it like `push_file`, set the policy version."""
        from tmax.training.weights.group import receive
        from tmax.training.weights.protocol import WeightUpdate

        group = self._tmax_weight_group
        if group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        upd = WeightUpdate.model_validate_json(update)
        t0 = time.perf_counter()
        # The engine's LM head of a tied model is the embedding: loading it again is
        # redundant, but its bucket still has to be received to keep the stream in step.
        hf = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        skip = {"lm_head.weight"} if getattr(hf, "tie_word_embeddings", False) else set()
        stream = receive(group, upd)
        counts = {"received": 0, "loaded": 0}

        def pairs():
            for name, t in stream:
                counts["received"] += 1
                if name not in skip:
                    counts["loaded"] += 1
                    yield name, t

        try:
            repacked = self._tmax_load(pairs(), upd.version)
        finally:
            # Rank 0 broadcasts every bucket whatever happens here: take the rest (if the
            # load stopped early or failed), or the group would be out of step for good.
            for _ in stream:
                counts["received"] += 1
        return {
            "n_tensors": counts["received"],
            "n_loaded": counts["loaded"],
            "repacked": repacked,
            "total_s": round(time.perf_counter() - t0, 4),
            "version": self._tmax_policy_version,
            "rank": group.rank,
        }

    def leave_weight_group(self) -> bool:
        group, self._tmax_weight_group = self._tmax_weight_group, None
        if group is not None:
            group.close()
        return group is not None

    def policy_version(self) -> int:
        return int(self._tmax_policy_version)

    def requests_in_flight(self) -> dict:
        """Tokens generated so far by each request this worker holds. Answered between two
        engine steps, so it is current even while the API server is slow to stream
        outputs (a progress probe for syncs during generation)."""
        reqs = getattr(self.model_runner, "requests", None) or {}  # type: ignore[attr-defined]
        return {str(rid): len(getattr(st, "output_token_ids", ()) or ()) for rid, st in reqs.items()}


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM has no TP group, e.g. in tests)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


def _worker_device(worker):
    device = getattr(worker, "device", None)
    if device is None:
        device = getattr(worker.model_runner, "device", None)
    if device is None or getattr(device, "type", "cpu") != "cuda":
        raise RuntimeError(f"the nccl weight transport needs a GPU worker (worker device: {device})")
    return device


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
