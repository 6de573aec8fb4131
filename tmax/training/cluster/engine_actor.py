"""`EngineActor`: one inference engine (a vLLM server) as a Ray actor.

A plain class: `training.cluster.actors.EngineGroup` wraps it with `ray.remote` where the
engines are created. Importing this module imports neither Ray nor torch."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from tmax.agents.policy import ModelError
from tmax.common.waiting import wait_until
from tmax.training.cluster.failover import SERVER_EXIT_WAIT_S
from tmax.training.net import ray_node_id

if TYPE_CHECKING:
    from tmax.common.records import JoinedWeightGroup
    from tmax.training.engine_options import EngineOptions
    from tmax.training.weights.protocol import WeightUpdate


class EngineActor:
    """Holds one inference engine. Rollout workers sample through it (threaded). A
    weight sync pauses the turns being sampled rather than waiting for them
    (`training.inference.engine`); each turn is tagged with the oldest weights version
    that produced it. A vLLM server that dies takes its actor with it, so Ray restarts both;
    a restarted actor reloads the last weights it was pushed."""

    def __init__(self, model_dir: str, ecfg: EngineOptions, seed: int, work_dir: str | None = None, tp: int | None = None):
        import ray

        from tmax.training.inference.engine import VLLMEngine

        self.engine = VLLMEngine.from_config(ecfg, model_dir, work_dir, tensor_parallel_size=tp)
        self._sampler = self.engine.sampler(seed)
        self._closing = False
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.engine.reload_last_push()
        threading.Thread(target=self._exit_with_server, daemon=True).start()

    def _exit_with_server(self) -> None:
        """A vLLM server that dies takes its actor with it, so Ray restarts both."""
        while not self._closing:
            time.sleep(1.0)
            self._exit_if_server_died()

    def _exit_if_server_died(self, wait_s: float = 0.0) -> None:
        """Exit the actor's process when its server is gone, or going within `wait_s`."""
        server = self.engine.server
        if server is not None and wait_until(lambda: not server.alive(), wait_s, 0.5) and not self._closing:
            os._exit(1)

    def node_id(self) -> str:
        return ray_node_id()

    def info(self) -> dict:
        return {"base_url": self.engine.base_url, "model": self.engine.served_model_name,
                "version": self.engine.policy_version, "mixed_turns": self.engine.mixed_turns}

    def sample(self, prompt_ids: list, max_tokens: int, temperature: float, top_p: float, seed: int | None):
        try:
            return self._sampler.sample(prompt_ids, max_tokens, temperature, top_p, seed)
        except ModelError:  # a server that died: the caller sees a dead engine and waits
            self._exit_if_server_died(SERVER_EXIT_WAIT_S)
            raise

    def push_weights(self, weights: dict, version: int) -> float:
        try:
            seconds = self.engine.push_weights(weights, version)
        except self.engine.error:  # a server that died: the caller sees a dead engine
            self._exit_if_server_died(SERVER_EXIT_WAIT_S)
            raise
        return seconds

    def num_workers(self) -> int:
        return self.engine.num_workers()

    def join_weight_group(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                          timeout_s: float) -> list:
        return self.engine.join_weight_group(host, port, rank_offset, world, backend, timeout_s)

    def receive_weights(self, update: WeightUpdate) -> float:
        # Blocks until learner rank 0 has broadcast the update (another actor, so the
        # two sides run at the same time).
        return self.engine.receive_weights(update)

    def weight_group(self) -> JoinedWeightGroup | None:
        # None on a fresh (e.g. Ray-restarted) engine: `WeightSync` then re-forms the group.
        return self.engine.weight_group

    def close(self) -> None:
        self._closing = True
        self.engine.close()
