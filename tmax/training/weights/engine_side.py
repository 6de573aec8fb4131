"""The engine's side of a weight sync: pause -> load -> reset prefix cache -> resume.

`EngineWeights` is mixed into `training.inference.engine.VLLMEngine` (which provides `_rpc`, a
`/collective_rpc` call to every vLLM worker, and `_control`, a POST to a dev-mode
endpoint). The loading itself happens in each worker (`vllm_ext`):

* object store (`push_weights`): the weights (HF names) are written to one safetensors
  file (temp + rename, so the engine never reads half a file), then `collective_rpc
  push_file` reloads it in every worker. About 50 ms for the nano model on CPU.
* LoRA (`push_weights` on an engine that serves an adapter, `adapter_start` set): the
  weights are the adapter's tensors; they are written as an adapter directory beside the
  start adapter's config (`training.weights.adapter.write_adapter`), and `collective_rpc
  push_adapter` loads it in place of the served adapter (same name, same id) in every
  worker. The base model's weights never move.
* process group (`join_weight_group` once per group, then `receive_weights(update)` per
  sync): every worker joins the learner's weight group, and each update is one
  `collective_rpc receive_weights` carrying the JSON manifest; the workers take the
  buckets by broadcast from learner rank 0 and load them. That HTTP call returns only
  once the broadcast is over, so learner rank 0 must send while it is pending, from
  another actor (`WeightSync`) or another thread.

Either way a sync pauses the engine instead of draining it: `POST /pause?mode=keep`
freezes the requests in flight where they are (nothing is aborted, nothing waits for
them), the weights load, `POST /reset_prefix_cache?reset_running_requests=true` drops
every KV block computed with the old weights (the frozen requests are preempted, so on
`POST /resume` they recompute their prefix and go on sampling with the new weights),
and generation resumes. A turn that spans a sync thus holds tokens of two versions; it
is tagged with the older one (`training.inference.engine.VLLMSampler`), and counted in
`mixed_turns`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tmax.common.records import (WEIGHTS_MANIFEST, JoinedWeightGroup, WeightGroupSpec, WeightsManifest, WorkerReply,
                                 read_record, write_record)

if TYPE_CHECKING:
    import torch

    from tmax.training.weights.protocol import WeightUpdate


# Next to an engine's weights.safetensors (or adapter/): the version it holds.
# A LoRA engine's last pushed adapter, in its work dir.
ADAPTER_DIR = "adapter"


class EngineWeights:
    """Weight loading for an engine; the host class sets `tied`, `work_dir` and
    `policy_version` and provides `_rpc(method, *args, timeout=)` and `_control(path)`,
    and raises its failures as `error` (an infrastructure error)."""

    tied: bool
    work_dir: Path
    policy_version: int
    adapter_start: Path | None = None  # the adapter the server started with (LoRA engines)
    error: type[Exception] = RuntimeError
    _rpc: Callable[..., list]
    _control: Callable[..., Any]

    def _init_weights(self) -> None:
        # One weight sync at a time; samples never wait for one (the server pauses them).
        self._sync_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.syncs_started = 0
        self.mixed_turns = 0  # turns whose request was in flight while a sync started
        self.weight_group: JoinedWeightGroup | None = None

    def push_weights(self, weights: dict[str, "torch.Tensor"], version: int) -> float:
        """Load `weights` (HF names) into the running engine through a file (the
        object-store transport); returns seconds taken."""
        import torch
        from safetensors.torch import save_file

        if self.adapter_start is not None:
            return self._push_adapter(self.adapter_start, weights, version)
        t0 = time.perf_counter()
        state = {}
        for name, t in weights.items():
            if self.tied and name == "lm_head.weight":
                continue  # the engine's LM head is the embedding
            state[name] = t.detach().to("cpu", torch.float32).contiguous()
        if not state:
            raise self.error("push_weights got no tensors")
        path = self.work_dir / "weights.safetensors"
        fd, tmp = tempfile.mkstemp(dir=self.work_dir, prefix=".weights-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(state, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._sync(lambda: self._rpc("push_file", str(path), str(int(version))), len(state), version)
        # The version of weights.safetensors, for a restarted engine (`reload_last_push`).
        write_record(self.work_dir / WEIGHTS_MANIFEST, WeightsManifest(version=int(version)))
        return time.perf_counter() - t0

    def _push_adapter(self, start: Path, tensors: dict[str, "torch.Tensor"], version: int) -> float:
        """Load an adapter's `tensors` (PEFT's saved names; the config is that of the `start`
        adapter) in place of the served adapter."""
        from tmax.training.weights.adapter import ADAPTER_CONFIG, write_adapter

        t0 = time.perf_counter()
        dest = write_adapter(self.work_dir / ADAPTER_DIR, (start / ADAPTER_CONFIG).read_text(), tensors)
        self._sync(lambda: self._rpc("push_adapter", str(dest), str(int(version))), len(tensors), version)
        write_record(self.work_dir / WEIGHTS_MANIFEST, WeightsManifest(version=int(version)))
        return time.perf_counter() - t0

    def reload_last_push(self) -> None:
        """Load the last weights (or adapter) pushed through a file (kept in the work dir) at
        their version: an engine restarted after its server died rejoins at the current
        policy version, not at the next sync."""
        from safetensors.torch import load_file

        from tmax.training.weights.adapter import ADAPTER_WEIGHTS

        manifest = self.work_dir / WEIGHTS_MANIFEST
        path = (self.work_dir / "weights.safetensors" if self.adapter_start is None
                else self.work_dir / ADAPTER_DIR / ADAPTER_WEIGHTS)
        if path.is_file() and manifest.is_file():
            v = read_record(manifest, WeightsManifest).version
            self.push_weights(load_file(str(path)), v)
            # Said where the engine's owner logs (a Ray actor's stderr reaches the driver's log).
            logging.getLogger(__name__).warning("engine restarted: reloaded the last %s pushed, version %d",
                                                "weights" if self.adapter_start is None else "adapter", v)

    # -- process-group transport -------------------------------------------------------

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                          backend: str = "gloo", timeout_s: float = 300.0) -> list[dict]:
        """Every worker of this engine joins the weight group whose rank 0 (learner rank
        0) serves the TCPStore at host:port, leaving any older one; worker ranks are
        rank_offset + TP rank. Blocks until all ranks have joined: the learner must
        join at the same time."""
        spec = WeightGroupSpec(host=host, port=port, rank_offset=rank_offset, world_size=world_size, backend=backend,
                               timeout_s=timeout_s)
        self.weight_group = None
        results = self._rpc("join_weight_group", spec.model_dump_json(), timeout=timeout_s + 60)
        ranks = sorted(r.rank for r in map(WorkerReply.of, results) if r is not None and r.rank is not None)
        if len(ranks) != len(results) or not ranks:
            raise self.error(f"join_weight_group: unexpected worker replies {results}")
        self.weight_group = JoinedWeightGroup(**spec.model_dump(), ranks=ranks)
        return results

    def receive_weights(self, update: "WeightUpdate") -> float:
        """Take one update by broadcast from learner rank 0 (which must be sending it
        meanwhile) into the paused engine; returns seconds."""
        if self.weight_group is None:
            raise self.error("receive_weights before join_weight_group")
        t0 = time.perf_counter()
        timeout = self.weight_group.timeout_s + 60
        self._sync(lambda: self._rpc("receive_weights", update.model_dump_json(), timeout=timeout),
                   len(update.names), update.version)
        return time.perf_counter() - t0

    def num_workers(self) -> int:
        """vLLM workers behind this server (its TP size): each is a rank of the group."""
        return len(self._rpc("policy_version"))

    def leave_weight_group(self) -> None:
        if self.weight_group is not None:
            self.weight_group = None
            self._rpc("leave_weight_group")

    # -- pause / load / reset / resume -------------------------------------------------

    def _sync(self, load: Callable[[], list], n_expected: int, version: int) -> None:
        """Pause (requests in flight stay frozen), load, drop the old KV, resume."""
        with self._sync_lock:
            with self._stats_lock:
                self.syncs_started += 1
            self._control("/pause?mode=keep&clear_cache=false")
            try:
                results = load()
                bad = [r for r in map(WorkerReply.of, results) if r is None or r.n_tensors != n_expected]
                if bad:
                    raise self.error(f"weight sync incomplete: sent {n_expected} tensors, workers answered {results}")
                # Frozen requests hold KV blocks of the old weights: preempt them (they
                # recompute on resume) so that the whole prefix cache can go.
                reset = self._control("/reset_prefix_cache?reset_running_requests=true", 60.0)
                if isinstance(reset, dict) and reset.get("success") is False:
                    raise self.error("reset_prefix_cache refused after a weight sync")
                # Before resuming: a turn sent from now on runs on the new weights only.
                self.policy_version = int(version)
            finally:
                self._control("/resume")

    def _count_mixed(self) -> None:
        with self._stats_lock:
            self.mixed_turns += 1
