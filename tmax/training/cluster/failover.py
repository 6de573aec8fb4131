"""Surviving actors that die while Ray restarts them: `FailoverSampler`, a rollout worker's
turns over the engine actors (`training.cluster.engine_actor.EngineActor` exits with its
server), and `WorkersDown`, which rollout workers may take an episode now. Whether an error
is an actor's death is `training.liveness`."""

from __future__ import annotations

import time
from typing import Any

# How long a turn waits for a restarting engine when none is up (a vLLM start, loaded).
ENGINE_RESTART_WAIT_S = 600.0
# How long a failed rollout worker gets no episode, at a time, while Ray restarts it.
WORKER_RETRY_S = 2.0
# How long an engine whose request failed (a turn, a weight push) waits to see whether its
# vLLM server is going down (it then exits, and Ray restarts it).
SERVER_EXIT_WAIT_S = 5.0


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

        from tmax.agents.policy import ModelError

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


class WorkersDown:
    """Rollout workers that failed (restarting under Ray): index -> [failed at, next episode
    no sooner than]. The loop sends episodes round-robin to the others meanwhile."""

    def __init__(self) -> None:
        self.down: dict[int, list[float]] = {}

    def next_live(self, start: int, n: int) -> int | None:
        """The first of `n` workers from `start` on (round-robin) that may take an episode now."""
        now = time.monotonic()
        return next((w % n for w in range(start, start + n) if self.down.get(w % n, [0, 0])[1] <= now), None)

    def up(self, index: int) -> None:
        self.down.pop(index, None)

    def failed(self, index: int, sent_at: float) -> bool:
        """Worker `index` failed: no episode for `WORKER_RETRY_S`. True when an episode sent
        at `sent_at` ran (it was sent before the failure was first seen)."""
        down = self.down.setdefault(index, [time.monotonic(), 0.0])
        down[1] = time.monotonic() + WORKER_RETRY_S
        return sent_at < down[0]
