"""Model policies: the one interface the Agent loop talks to.

Two families implement `Policy`, and the *same* `agents.loop.Agent` drives both:

* chat policies (`agents.chat_policy.ChatPolicy`) send the message list to an
  OpenAI-compatible /chat/completions endpoint and get back an assistant message,
  possibly with native `tool_calls`;
* token policies (`agents.token_policy.TokenPolicy`) keep the exact token context,
  ask a `TokenSampler` for token ids + logprobs, and parse tool calls from the raw
  text. Their `TokenTrace` lets a trainer rebuild the exact sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tmax.common.records import UsageRecord


# A model request that has not answered in 10 minutes is stuck (a 16k-token reply at 30
# tokens/s takes 9); the loop retries it like any other transient error.
DEFAULT_MODEL_TIMEOUT_S = 600.0


class ModelError(RuntimeError):
    """A model call failed in a way worth retrying (5xx, timeout, connection reset)."""


class FatalModelError(RuntimeError):
    """Auth, not-found, permission or bad-parameter errors: never retried."""


class ContextOverflow(RuntimeError):
    """The context window or the token budget is used up: the episode ends cleanly (or, with
    compaction on, is compacted and the turn tried again). `prompt_tokens`: the request's
    length as the server counted it, where its error said."""

    def __init__(self, message: str, prompt_tokens: int | None = None) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int = 0
    # What the tokens cost in US dollars, where the server reports it or the prices are
    # configured (`ChatPolicy(prices=...)`); 0.0 where nobody knows.
    cost_usd: float = 0.0

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.total_tokens += other.total_tokens
        self.reasoning_tokens += other.reasoning_tokens
        self.cost_usd += other.cost_usd

    @property
    def context_tokens(self) -> int:
        """Tokens of one turn's context: its prompt and its completion (the next prompt holds both)."""
        return self.total_tokens or (self.prompt_tokens + self.completion_tokens)

    @classmethod
    def from_record(cls, record: UsageRecord) -> "Usage":
        """The totals of a saved `usage.json`."""
        return cls(prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens,
                   total_tokens=record.total_tokens, reasoning_tokens=record.reasoning_tokens,
                   cost_usd=record.cost_usd)


@dataclass
class TokenTrace:
    """The exact token stream of one episode, for training.

    `prompt_ids` is the rendered system + user prompt (with tools). `ids` follows it:
    sampled tokens (mask 1, their sampler logprob) interleaved with observation /
    template tokens (mask 0, logprob 0.0). prompt_ids + ids is the context the
    sampler saw, token for token. The trainer keeps this object as it is, from the
    rollout to the packed batch (`training.learner.packing.TrainSample`).
    """

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    # Per sampled turn: the policy version (weights step) that sampled it.
    turn_versions: list[int] = field(default_factory=list)

    def extend(self, ids: list[int], logprobs: list[float] | None, trainable: bool) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([1 if trainable else 0] * len(ids))

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def num_sampled(self) -> int:
        """Tokens the policy sampled: the ones a trainer takes a loss on."""
        return sum(self.mask)


@dataclass
class ModelTurn:
    """One model response, already shaped as the assistant message for history."""

    message: dict[str, Any]  # {"role": "assistant", "content": str, "tool_calls": [...]?}
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    latency_s: float = 0.0


@runtime_checkable
class Policy(Protocol):
    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelTurn:
        """Return the next assistant turn. Raises ModelError (retryable),
        FatalModelError or ContextOverflow."""
        ...


@runtime_checkable
class Compactable(Protocol):
    """A policy whose session can be compacted (`agents.compaction`): it writes the summary
    in a turn aside from the conversation, then starts over from the rebuilt messages.
    `ChatPolicy` and `TokenPolicy` are; a token policy keeps each stretch between two
    compactions as a token segment of its own."""

    @property
    def context_window(self) -> int | None:
        """The model's context window in tokens, once known (None: not known)."""
        ...

    def complete_aside(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> ModelTurn:
        """A turn on `messages` (the conversation plus a request) that leaves no trace: the
        next `complete` continues as if it had not happened. At most `max_tokens`."""
        ...

    def restart(self, context_tokens: int) -> None:
        """The next `complete` starts a new context from its messages (about
        `context_tokens` long); a token policy closes its segment here."""
        ...

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int | None:
        """The exact prompt length of `messages`, where the policy can render it (None: it cannot)."""
        ...


@dataclass
class SampledTokens:
    ids: list[int]
    logprobs: list[float]  # sampler logprob of each sampled id (after temperature)
    finish_reason: str | None = None  # "stop" | "length"
    policy_version: int = 0


@runtime_checkable
class TokenSampler(Protocol):
    """Token ids in, sampled token ids + their logprobs out. Training implements this
    on top of its inference engine (vLLM /v1/completions with a token-id prompt)."""

    def sample(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
    ) -> SampledTokens: ...
