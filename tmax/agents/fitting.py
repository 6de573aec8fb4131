"""Fitting requests to the context window (`agents.compaction` and the loop use it).

* `TokenCounter`: how many tokens a request is before it goes out. The policy's own count
  where it has one (a token policy renders the chat template and tokenizes); otherwise an
  estimate from characters, at the characters-per-token ratio of the last request whose
  prompt tokens the server reported (`calibrate`), and `UNCALIBRATED_CHARS_PER_TOKEN` (on
  the safe side: more tokens than most tokenizers make) before any was. Estimates carry
  `ESTIMATE_MARGIN` more, for text that tokenizes worse than the conversation so far. The
  next request of a conversation (`next_request`) is the last one's reported context (its
  prompt and completion) plus an estimate of only the messages added since.
* `clip_text` / `clip_message`: a long text cut to a size, its head and tail kept and a
  note of how much was cut where; a message's content and the string arguments of its tool
  calls (which stay valid JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tmax.agents.policy import Policy

UNCALIBRATED_CHARS_PER_TOKEN = 2.0
# No tokenizer makes fewer than one or more than ten JSON characters a token: a ratio outside
# these comes from a server whose usage counts something else, and is bounded.
CHARS_PER_TOKEN_RANGE = (1.0, 10.0)
ESTIMATE_MARGIN = 1.1
CLIP_NOTE = "\n[... {cut} characters cut here to fit the context window ...]\n"


@dataclass(frozen=True)
class TokenCount:
    tokens: int
    estimated: bool  # from characters (the policy cannot count)


def request_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    """The measure an estimate scales: the request's messages and tools as JSON (characters
    as they are: escaping non-ASCII would count one character of a word as six)."""
    return len(json.dumps(messages, ensure_ascii=False)) + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)


class TokenCounter:
    """Counts requests for one session (see the module doc)."""

    def __init__(self) -> None:
        self.chars_per_token: float | None = None  # measured on the last reported request
        self._reported: tuple[int, int] | None = None  # (messages, tokens) the server counted, reply included

    def calibrate(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], prompt_tokens: int,
                  completion_tokens: int = 0) -> None:
        """The server counted `prompt_tokens` for this request (0: it did not say), and
        `completion_tokens` for its answer (the next message of the conversation)."""
        self._reported = (len(messages) + 1, prompt_tokens + completion_tokens) if prompt_tokens > 0 else None
        if prompt_tokens > 0:
            low, high = CHARS_PER_TOKEN_RANGE
            self.chars_per_token = min(high, max(low, request_chars(messages, tools) / prompt_tokens))

    @property
    def ratio(self) -> float:
        return (self.chars_per_token or UNCALIBRATED_CHARS_PER_TOKEN) / ESTIMATE_MARGIN

    def count(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> TokenCount:
        counter = getattr(policy, "count_tokens", None)
        exact = counter(messages, tools) if counter is not None else None
        if exact is not None:
            return TokenCount(exact, False)
        return TokenCount(int(request_chars(messages, tools) / self.ratio) + 1, True)

    def forget(self) -> None:
        """The conversation was replaced (a compaction, a resumed session): no reported context to extend."""
        self._reported = None

    def next_request(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> TokenCount:
        """The size of the conversation's next request: counted exactly where the policy can;
        else the last reported context plus an estimate of the messages added since."""
        whole = self.count(policy, messages, tools)
        if not whole.estimated or self._reported is None or len(messages) < self._reported[0]:
            return whole
        seen, tokens = self._reported
        added = messages[seen:]
        return TokenCount(tokens + (int(request_chars(added, []) / self.ratio) + 1 if added else 0), True)

    def chars_for(self, tokens: int) -> int:
        """About how many characters of output make `tokens` tokens (on the safe side)."""
        return max(0, int(tokens * self.ratio))


class Clip(BaseModel):
    """One text cut to fit: where (a step's output, or a message of a summary request) and how much."""

    where: str
    chars: int  # its length before
    kept: int  # characters kept (head and tail)
    file: str | None = None  # where the whole output is saved, when it is


def clip_text(text: str, max_chars: int) -> tuple[str, int]:
    """`text` with its middle cut so that at most `max_chars` of it stay, and the characters cut."""
    if len(text) <= max_chars:
        return text, 0
    head = max_chars // 2
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}{CLIP_NOTE.format(cut=cut)}{text[len(text) - tail:] if tail else ''}", cut


def _clip_arguments(arguments: str, max_chars: int) -> tuple[str, int]:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return clip_text(arguments, max_chars)
    if not isinstance(parsed, dict):
        return arguments, 0
    total = 0
    for key, value in parsed.items():
        if isinstance(value, str):
            parsed[key], cut = clip_text(value, max_chars)
            total += cut
    return (json.dumps(parsed), total) if total else (arguments, 0)


def clip_message(message: dict[str, Any], max_chars: int) -> tuple[dict[str, Any], int]:
    """A copy of `message` whose content and tool-call string arguments are each at most
    about `max_chars`, and the characters cut (0: the message itself, unchanged)."""
    out, total = dict(message), 0
    if isinstance(out.get("content"), str):
        out["content"], cut = clip_text(out["content"], max_chars)
        total += cut
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                function["arguments"], cut = _clip_arguments(function["arguments"], max_chars)
                total += cut
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return (out, total) if total else (message, 0)
