"""The learner's side of a weight sync, and `WeightSync`, the driver that runs one.

`WeightSourceMixin` gives a learner actor (rank 0 and the other ranks) the methods a sync
calls on it; `WeightSync` calls them and the engine actors' (`engine_side`) after every
step. Ray and torch are imported lazily: importing this module is cheap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmax.common.waiting import wait_until
from tmax.training.liveness import actor_died
from tmax.training.weights.transports import DEFAULT_BUCKET_MB, resolve_transport

if TYPE_CHECKING:
    import torch
    from ray import ObjectRef

    from tmax.training.config import LearnConfig
    from tmax.training.weights.group import WeightGroup, WeightSender
    from tmax.training.weights.protocol import WeightUpdate


@dataclass(frozen=True)
class SyncPayload:
    """What one sync hands each engine: a LoRA adapter's tensors or the full weights, and
    their bytes (`weights/sync_bytes` in the metrics)."""

    adapter: bool
    nbytes: int


class WeightSourceMixin:
    """Learner rank 0's end of the weight group, as methods of a learner actor (Ray calls
    them). The actor sets `self.learner` (a `training.learner.learner.Learner`) and, when it is
    one of several learner ranks, `self.rank`.

    A sync is `prepare_weights(version)` on every learner rank (gathering the full
    weights is a collective), the returned update handed to every engine's receive, and
    `send_weights()` on rank 0 while the engines receive."""

    rank: int = 0
    _weight_group: WeightGroup | None = None
    _weight_sender: WeightSender | None = None

    def learner_device_type(self) -> str:
        import torch

        return torch.device(getattr(self.learner, "device", "cpu")).type  # type: ignore[attr-defined]

    def sync_payload(self) -> SyncPayload:
        """What a sync carries from this learner (no gathering)."""
        learner = self.learner  # type: ignore[attr-defined]
        return SyncPayload(adapter=learner.peft is not None, nbytes=learner.sync_nbytes())

    def weight_rendezvous(self) -> tuple[str, int]:
        from tmax.training.net import free_port, node_ip

        return node_ip(), free_port()

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str,
                          bucket_mb: float = DEFAULT_BUCKET_MB, timeout_s: float = 300.0) -> int:
        """Become rank 0 (and the TCPStore server) of a new group, leaving any older one;
        blocks until every engine worker has joined too."""
        from tmax.training.weights.group import WeightGroup, WeightSender

        if self.rank != 0:
            raise RuntimeError("only learner rank 0 belongs to the weight group")
        self.leave_weight_group()
        device = getattr(self.learner, "device", None) if backend == "nccl" else "cpu"  # type: ignore[attr-defined]
        self._weight_group = WeightGroup(host, port, 0, world_size, backend, device=device, timeout_s=timeout_s)
        self._weight_sender = WeightSender(self._weight_group, bucket_mb)
        return world_size

    def prepare_weights(self, version: int) -> WeightUpdate | None:
        weights = self.learner.named_weights()  # type: ignore[attr-defined]
        if self.rank != 0:
            return None
        if self._weight_sender is None:
            raise RuntimeError("prepare_weights before join_weight_group")
        return self._weight_sender.prepare(weights, version)

    def send_weights(self) -> None:
        if self._weight_sender is None:
            raise RuntimeError("send_weights before join_weight_group")
        self._weight_sender.send()

    def leave_weight_group(self) -> None:
        group, self._weight_group, self._weight_sender = self._weight_group, None, None
        if group is not None:
            group.close()


def push_to_engines(engines: list, weights: dict[str, torch.Tensor] | ObjectRef, version: int, wait_s: float = 600.0) -> float:
    """The object-store transport: `weights` (a dict or the ref of one) to every engine's
    `push_weights`; returns the slowest engine's seconds. An engine that died (before or
    during the push) is skipped: Ray restarts it, it reloads the last weights it took, and
    the next sync brings it up to date; until then its turns carry the old version and the
    staleness limit drops them. While no engine is up (all restarting), the push waits for
    one, up to `wait_s`, and sends the weights again. A dead learner (the weights' source)
    is not an engine's failure: its error is raised."""
    import ray

    ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)

    def one_round() -> list[float] | None:
        seconds = []
        for call in [e.push_weights.remote(ref, version) for e in engines]:
            try:
                seconds.append(float(ray.get(call)))
            except ray.exceptions.RayActorError as err:
                if not actor_died(err, engines):
                    raise  # the learner that holds the weights died
        return seconds or None

    seconds = wait_until(one_round, wait_s, 2.0)
    if not seconds:
        raise RuntimeError(f"no engine took the weights: every engine actor was down for {wait_s:.0f} s")
    return max(seconds)


def load_checkpoint(engines: Any, ckpt_dir: str | Path, version: int) -> float:
    """Serve a checkpoint from disk on running engines (an `EngineGroup`: the weights a fresh
    server started on that directory would load); returns the slowest engine's seconds."""
    from safetensors.torch import load_file

    weights: dict = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return push_to_engines(engines.engines, weights, version)


class WeightSync:
    """Learner -> engines after every step, over `cfg.engine.weight_transport`.

    `learner` is a `training.cluster.actors.LearnerGroup`, `engines` an `EngineGroup`
    (a group of one each on a single machine). For the object store, rank 0's weights go to every engine's
    `push_weights`; a LoRA learner's are its adapter's tensors only (`payload`), which the
    engines load in place of the adapter they serve. For gloo / NCCL, learner rank 0 is rank 0 of a weight group and the
    workers of engine i are the next ranks (TP workers each); per sync every learner rank
    prepares (a collective gather), every engine starts receiving, and rank 0 then
    broadcasts. The receives and the send are calls on different actors, so they run at
    the same time: no side waits for a call that can only start after it returns.

    Before each process-group sync the engines say which group they are in: an engine
    that Ray restarted (a fresh vLLM server, in no group) or one that died for good
    makes the group re-form with the live engines, so a restarted engine gets the
    weights again from the next sync on."""

    def __init__(self, cfg: LearnConfig, learner: Any, engines: Any):
        import ray

        self.learner, self.ecfg = learner, cfg.engine
        self.rank0 = learner.rank0
        self.engines = list(engines.engines)
        on_cuda = ray.get(self.rank0.learner_device_type.remote()) == "cuda"
        # A LoRA learner hands over its adapter only (`Learner.named_weights`).
        self.payload: SyncPayload = ray.get(self.rank0.sync_payload.remote())
        self.transport = resolve_transport(self.ecfg.weight_transport, on_cuda, self.payload.adapter)
        self.members: list = []  # engines in the current weight group
        self.port: int | None = None
        self.world = 0
        self.regroups = 0  # times the group re-formed after it first formed
        if self.transport != "object_store":
            self._form_group(self.engines)

    def _form_group(self, engines: list) -> None:
        import ray

        ecfg = self.ecfg
        host, port = ray.get(self.rank0.weight_rendezvous.remote())
        workers = ray.get([e.num_workers.remote() for e in engines])
        world = 1 + sum(workers)
        offsets = [1 + sum(workers[:i]) for i in range(len(workers))]
        joins = [e.join_weight_group.remote(host, port, off, world, self.transport, ecfg.weight_timeout_s)
                 for e, off in zip(engines, offsets)]
        ray.get([self.rank0.join_weight_group.remote(host, port, world, self.transport, ecfg.weight_bucket_mb,
                                                     ecfg.weight_timeout_s)] + joins)
        self.regroups += bool(self.members)
        self.members, self.port, self.world = list(engines), port, world

    def _probe(self) -> tuple[list, bool]:
        """(the engines up now, whether one of them is outside the current group). An
        engine that is dead or still restarting (Ray answers ActorUnavailableError, a
        RayActorError) sits this sync out."""
        import ray

        live, stale = [], False
        for e in self.engines:
            try:
                group = ray.get(e.weight_group.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
            live.append(e)
            stale |= group is None or group.port != self.port
        return live, stale

    def _group_members(self) -> list:
        """The engines that receive this sync, re-forming the group when that set changed.
        While no engine is up (all restarting), wait for one, up to the start-up timeout."""
        def some_live() -> tuple[list, list] | None:
            live, stale = self._probe()
            return (live, stale) if live else None

        found = wait_until(some_live, self.ecfg.startup_timeout_s, 2.0)
        if not found:
            raise RuntimeError("no engine can take the weights: every engine actor is down")
        live, stale = found
        if stale or len(live) != len(self.members):
            self._form_group(live)
        return live

    def push(self, version: int) -> float:
        """Sync the learner's current weights as `version`; the slowest engine's seconds."""
        import ray

        if self.transport == "object_store":
            return push_to_engines(self.engines, self.learner.named_weights(), version,
                                   self.ecfg.startup_timeout_s)
        engines = self._group_members()
        update = self.learner.prepare_weights(version)
        receives = [e.receive_weights.remote(update) for e in engines]
        send = self.rank0.send_weights.remote()
        # The first failure on either side surfaces at once (the others then fail at the
        # weight group's timeout; the run cannot go on without its engines anyway).
        pending = receives + [send]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        return max(ray.get(receives))
