"""Text prompts with an answer: the `training.generator.Generator` of `tasks.format = "text"`.

No task directory, sandbox or verifier: `tasks.train` is a JSONL file, one
`{"id": ..., "prompt": ..., "answer": ...}` object a line. An episode is one model turn on
the prompt (the same `agents.token_policy.TokenPolicy` as an agent's, so the trace is
token-exact) with the rollout section's sampling and budgets; it scores 1 when the answer
appears in what was sampled, else 0. It shows what another environment needs to train
through `tmax learn`: prompts, a worker whose `generate` returns scored episodes, and nothing
of the loop's insides.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tmax.agents.policy import ContextOverflow
from tmax.common.errors import ConfigError
from tmax.common.records import TaskCounts
from tmax.training.config import LearnConfig, RolloutConfig
from tmax.training.generator import GeneratedEpisode, EpisodeRequest, Rollout, WorkerSpec


class TextPrompt(BaseModel):
    """One line of a text task file."""

    id: str
    prompt: str
    answer: str


def load_prompts(path: str | Path) -> dict[str, TextPrompt]:
    """The prompts of the JSONL file at `path` by id; a bad line or a repeated id is bad input."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tasks.format = \"text\" needs tasks.train to be a JSONL file of prompts: {path} is "
                          "not a file")
    prompts: dict[str, TextPrompt] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = TextPrompt.model_validate_json(line)
        except ValidationError as e:
            raise ConfigError(f"{path}:{n}: not a text prompt ({{\"id\", \"prompt\", \"answer\"}}): {e}") from None
        if p.id in prompts:
            raise ConfigError(f"{path}:{n}: prompt id {p.id!r} appears twice")
        prompts[p.id] = p
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


class TextGenerator:
    """The prompts of `tasks.train`, episodes run by `TextWorker`s; nothing to clean up after."""

    labels = None

    def __init__(self, cfg: LearnConfig, prompts: dict[str, TextPrompt]):
        self.rollout = cfg.rollout
        self.by_id = prompts
        self.prompts = sorted(prompts)

    @classmethod
    def load(cls, cfg: LearnConfig) -> TextGenerator:
        return cls(cfg, load_prompts(cfg.tasks.train))

    def worker(self, model_dir: str) -> WorkerSpec:
        return WorkerSpec(TextWorker, {"model_dir": model_dir, "prompts": self.by_id, "rollout": self.rollout})

    def warm_ahead(self, workers: list[Any]) -> _NothingAhead:
        return _NothingAhead()

    def task_counts(self) -> TaskCounts:
        return TaskCounts(tasks_runnable=len(self.prompts))


class _NothingAhead:
    def fill(self, coming: Any) -> None:
        """An episode of a text prompt needs nothing started ahead."""


class TextWorker:
    """One model turn per episode (`training.generator.EpisodeWorker`), as a Ray actor."""

    def __init__(self, model_dir: str, prompts: dict[str, TextPrompt], rollout: RolloutConfig, sampler: Any,
                 slots: int = 1):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts, self.rollout, self.sampler = prompts, rollout, sampler

    def generate(self, req: EpisodeRequest, version: int) -> GeneratedEpisode:
        from tmax.agents.token_policy import TokenPolicy

        item, r, t0, started_at = self.prompts[req.task_dir], self.rollout, time.monotonic(), time.time()
        policy = TokenPolicy(self.sampler, self.tokenizer, temperature=r.temperature, top_p=r.top_p,
                             max_response_tokens=r.response_budget, max_context_tokens=r.context_budget,
                             max_turn_tokens=r.max_tokens, max_prompt_tokens=r.max_prompt_tokens, seed=req.seed)
        status = "answered"
        try:
            policy.complete([{"role": "user", "content": item.prompt}], [])
        except ContextOverflow:
            status = "context_overflow"
        except Exception as e:  # the engine failed, not the policy: re-queued, never scored
            return GeneratedEpisode(infra_error=f"inference server failed: {e}", infra_kind="model")
        trace = policy.trace
        said = self.tokenizer.decode([t for t, m in zip(trace.ids, trace.mask) if m], skip_special_tokens=True)
        reward = 1.0 if status == "answered" and item.answer in said else 0.0
        rollout = Rollout(task_id=item.id, group_id=req.group_id, sample_index=req.sample_index, seed=req.seed,
                          trace=trace, reward=reward, status=status, steps=len(trace.turn_versions),
                          policy_version=min(trace.turn_versions, default=version),
                          truncated=status == "context_overflow", submitted=status == "answered", harness="text",
                          timings={"total_s": round(time.monotonic() - t0, 4)}, started_at=round(started_at, 3))
        return GeneratedEpisode(rollout=rollout)

    def prewarm(self, prompt: str) -> bool:
        return False

    def node_id(self) -> str:
        from tmax.training.net import ray_node_id

        return ray_node_id()

    def close(self) -> None:
        """Nothing to release: a text episode holds no sandbox."""
