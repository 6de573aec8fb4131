"""`FailoverSampler`: a rollout worker's turns over the engine actors, surviving engines
that die (Ray restarts them; `training.cluster.actors.EngineActor` exits with its server)."""

from __future__ import annotations

import time
from typing import Any

# How long a turn waits for a restarting engine when none is up (a vLLM start, loaded).
ENGINE_RESTART_WAIT_S = 600.0


class FailoverSampler:
    """`agents.policy.TokenSampler` over the engine actors (picklable): turns go to the
    worker's own engine, and while it is down (dead, or restarting under Ray) to the
    next live one, so an engine failure costs no episode. While every engine is down the
    turn waits for one to come back (Ray restarts them), up to `restart_wait_s`: the request
    in flight is sent again, not the episode lost. Every turn keeps the logprobs and the
    weights version of the engine that sampled it, so mixing engines within an episode is
    exact for the loss."""

    def __init__(self, engines: list[Any], first: int = 0, restart_wait_s: float = ENGINE_RESTART_WAIT_S):
        self.engines = engines
        self.first = first
        self.restart_wait_s = restart_wait_s

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None):
        import ray

        from agents.policy import ModelError

        deadline = time.monotonic() + self.restart_wait_s
        while True:
            errors = []
            for k in range(len(self.engines)):
                engine = self.engines[(self.first + k) % len(self.engines)]
                try:
                    return ray.get(engine.sample.remote(list(prompt_ids), max_tokens, temperature, top_p, seed))
                except ray.exceptions.RayActorError as e:
                    errors.append(type(e).__name__)
            if time.monotonic() > deadline:
                raise ModelError(f"every engine actor is down ({', '.join(errors)}) "
                                 f"and none came back within {self.restart_wait_s:.0f} s")
            time.sleep(1.0)
