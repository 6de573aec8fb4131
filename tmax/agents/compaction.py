"""Compaction: a long session goes on past its context window on a summary the model writes.

When a turn's context (prompt + completion) reaches `compaction_threshold` of the window
(`Compactor.window`: the smaller of `context_budget` and the server's window), or when the
user asks (`/compact [focus]`), the loop (`agents.loop.Agent`) compacts before its next
model call:

1. the model is sent the conversation as it is plus `SUMMARY_PROMPT` (the task, what was
   done, the state of the files and the shell, open items; the user's focus when given)
   and answers in a turn aside (`policy.Compactable.complete_aside`: no part of a token
   policy's record, so the summary is not a training sample);
2. the context is rebuilt (`rebuild`): the system prompt; one user message holding the task
   as first given and every follow-up the user typed, verbatim, then the summary; then the
   last `KEEP_TURNS` turns verbatim (fewer, or none, where they would leave the rebuilt
   context over `TAIL_SHARE` of the threshold);
3. the policy restarts on the rebuilt messages (a token policy starts a new segment: each
   segment's prompt ids are the rebuilt context exactly as sent).

A summary that fails (a model error, an empty answer, a rebuilt context still over the
threshold, Ctrl-C) changes nothing: the session keeps its messages, the record says why,
and automatic compaction waits until the context has grown by `RETRY_GROWTH` of the window
before it tries again.

`SessionContext` is what the session keeps for compaction, also across `tmax run --resume`
(`compaction.json`): the task message, the follow-ups, the record of every compaction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from tmax.agents.policy import Compactable, ContextOverflow, FatalModelError, ModelError, ModelTurn, Usage
from tmax.agents.prompts import render
from tmax.agents.settings import AgentSettings

KEEP_TURNS = 2  # turns (an assistant message and what answered it) kept verbatim
TAIL_SHARE = 0.5  # kept turns only while the rebuilt context stays under this share of the threshold
RETRY_GROWTH = 0.05  # after a failure, automatic compaction waits for this share of the window more
SUMMARY_MAX_TOKENS = 4096  # the summary's cap, and at most an eighth of the window
SUMMARY_MIN_TOKENS = 256

SUMMARY_PROMPT = """\
The context window is nearly full, so this conversation is being compacted: everything above \
will be replaced by a summary that you write now, followed by your last few turns. The task \
and every follow-up task from the user are kept word for word, so do not copy them. Do not \
call any tool: answer with the summary only, in plain text, under these four headings.

## Task
What the user wants, in a sentence or two, and which follow-up task is being worked on now.

## Done so far
The steps taken and what they showed: what worked, what failed and why.

## State of the files and the shell
Files created or changed (paths, what they hold now), the working directory, environment \
variables, background processes, what was installed.

## Open items
What is left to do, in order, and what to check before submitting.{{focus}}"""

FOCUS_TEMPLATE = "\n\nThe user asks you to keep this in focus: {{focus}}"
FOLLOW_UP_HEADING = "## Follow-up task {{n}} from the user (verbatim)"
SUMMARY_HEADING = (
    "## Summary of the work so far\n\n(You wrote this when the earlier conversation was compacted "
    "to fit the context window; your last turns follow it unchanged.)"
)
_THINK = re.compile(r"^.*</think>\s*", re.S)


class CompactionRecord(BaseModel):
    """One compaction, as the screen, `--json`, `compaction.json` and `tmax show` see it."""

    segment: int  # the token / message segment it closed (1 = the first compaction's)
    step: int  # model turns of the session before it
    reason: Literal["auto", "manual"]
    ok: bool
    tokens_before: int
    tokens_after: int | None = None
    estimated: bool = False  # tokens_after estimated from characters (the policy cannot count)
    window: int
    focus: str | None = None
    summary: str = ""
    summary_tokens: int = 0  # what the summary call sampled
    kept_turns: int = 0
    follow_ups: int = 0  # follow-ups carried verbatim (beside the task)
    prefix: int = 0  # messages of the rebuilt context before its kept turns
    kept_messages: int = 0  # the kept turns' messages
    error: str | None = None


class SessionContext(BaseModel):
    """What compaction keeps of a session: the task as first sent, the follow-ups (merged
    into the carried message, or still where they were typed), every compaction so far."""

    task: dict[str, Any] | None = None
    follow_ups: list[str] = Field(default_factory=list)
    follow_up_at: list[int] = Field(default_factory=list)  # indices in the messages
    compactions: list[CompactionRecord] = Field(default_factory=list)

    @classmethod
    def of(cls, messages: list[dict[str, Any]]) -> SessionContext:
        """A session whose first user message (the task) is in `messages`."""
        return cls(task=dict(messages[_first_user(messages)]))

    @property
    def kept(self) -> bool:
        """Worth a record: a compaction or a follow-up (else the task is the first user message)."""
        return bool(self.compactions or self.follow_ups or self.follow_up_at)

    @property
    def segments(self) -> int:
        """Segments closed so far (successful compactions)."""
        return sum(1 for c in self.compactions if c.ok)


@dataclass(frozen=True)
class ContextUse:
    """How full the context window is, for the screen, `/usage` and usage.json."""

    used: int  # tokens of the last turn's context
    window: int
    threshold: float | None  # the share that sets automatic compaction off; None: off
    compactions: int

    @property
    def left(self) -> int:
        return max(0, self.window - self.used)


@dataclass
class Outcome:
    """A compaction's result: the rebuilt messages and session context (None when it
    failed), its record, and what the summary call used."""

    record: CompactionRecord
    messages: list[dict[str, Any]] | None = None
    context: SessionContext | None = None
    usage: Usage | None = None


def summary_prompt(focus: str | None) -> str:
    return render(SUMMARY_PROMPT, focus=render(FOCUS_TEMPLATE, focus=focus.strip()) if focus and focus.strip() else "")


def carried_message(task: str, follow_ups: list[str], summary: str) -> str:
    """The user message a rebuilt context starts with: task, follow-ups, summary."""
    parts = [task]
    for n, text in enumerate(follow_ups, 1):
        parts.append(f"{render(FOLLOW_UP_HEADING, n=str(n))}\n\n{text}")
    parts.append(f"{SUMMARY_HEADING}\n\n{summary}")
    return "\n\n".join(parts)


def _first_user(messages: list[dict[str, Any]]) -> int:
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return i
    raise ValueError("the conversation has no user message")


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else json.dumps(content)


def rebuild(messages: list[dict[str, Any]], ctx: SessionContext, summary: str,
            keep: int) -> tuple[list[dict[str, Any]], SessionContext]:
    """The context after a compaction that keeps the last `keep` turns verbatim, and the
    session context that goes with it (follow-ups before the kept turns carried)."""
    first = _first_user(messages)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > first]
    start = turns[-keep] if keep else len(messages)
    head = messages[:first]
    carried = [*ctx.follow_ups, *(_text(messages[i]) for i in ctx.follow_up_at if i < start)]
    task = ctx.task or messages[first]
    merged = {"role": "user", "content": carried_message(_text(task), carried, summary)}
    later = [i - start + len(head) + 1 for i in ctx.follow_up_at if i >= start]
    rebuilt = [*head, merged, *messages[start:]]
    return rebuilt, SessionContext(task=dict(task), follow_ups=carried, follow_up_at=later,
                                   compactions=list(ctx.compactions))


def turns_after_task(messages: list[dict[str, Any]]) -> int:
    first = _first_user(messages)
    return sum(1 for m in messages[first + 1:] if m.get("role") == "assistant")


class Compactor:
    """When to compact (`due`) and how (`compact`), for one session."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self._failed_at: int | None = None  # context tokens at the last failure

    def window(self, policy: Any) -> int:
        known = policy.context_window if isinstance(policy, Compactable) else None
        return min(self.settings.context_budget, known) if known else self.settings.context_budget

    def due(self, policy: Any, used: int) -> bool:
        """Automatic compaction: on, possible with this policy, and the context past the threshold."""
        if not self.settings.compaction or not isinstance(policy, Compactable):
            return False
        window = self.window(policy)
        point = self.settings.compaction_threshold * window
        if self._failed_at is not None:
            point = max(point, self._failed_at + RETRY_GROWTH * window)
        return used >= point

    def use(self, policy: Any, used: int, compactions: int) -> ContextUse:
        threshold = self.settings.compaction_threshold if self.settings.compaction else None
        return ContextUse(used, self.window(policy), threshold, compactions)

    def compact(self, policy: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ctx: SessionContext,
                used: int, *, step: int, reason: Literal["auto", "manual"], focus: str | None,
                ask: Callable[[list[dict[str, Any]], int], ModelTurn]) -> Outcome:
        """Summarise and rebuild; `ask(messages, max_tokens)` is the summary call (with the
        loop's retries). A failure leaves `messages` as they are (`Outcome.messages` None)."""
        window = self.window(policy)
        record = CompactionRecord(segment=ctx.segments + 1, step=step, reason=reason, ok=False, tokens_before=used,
                                  window=window, focus=focus or None)
        if not isinstance(policy, Compactable):
            return self._failed(record, "this model policy cannot compact a session")
        if turns_after_task(messages) == 0:
            return self._failed(record, "nothing to compact yet: the model has not answered")
        cap = min(self.settings.max_tokens, SUMMARY_MAX_TOKENS, max(SUMMARY_MIN_TOKENS, window // 8))
        try:
            turn = ask([*messages, {"role": "user", "content": summary_prompt(focus)}], cap)
        except (ModelError, FatalModelError, ContextOverflow) as e:
            return self._failed(record, f"the summary call failed: {e}")
        except KeyboardInterrupt:
            return self._failed(record, "the summary call was interrupted")
        summary = _THINK.sub("", _text(turn.message)).strip()
        record.summary, record.summary_tokens = summary, turn.usage.completion_tokens
        if not summary:
            return self._failed(record, "the model's summary was empty", turn.usage)
        fitted = self._fit(policy, messages, tools, ctx, summary, used)
        if fitted is None:
            return self._failed(record, "the summary is too long: the rebuilt context would still be over "
                                        f"{self.settings.compaction_threshold:.0%} of the window", turn.usage)
        rebuilt, new_ctx, keep, (tokens, estimated) = fitted
        self._failed_at = None
        record = record.model_copy(update=dict(ok=True, tokens_after=tokens, estimated=estimated, kept_turns=keep,
                                               follow_ups=len(new_ctx.follow_ups), prefix=_first_user(rebuilt) + 1,
                                               kept_messages=len(rebuilt) - _first_user(rebuilt) - 1))
        new_ctx.compactions.append(record)
        return Outcome(record, rebuilt, new_ctx, turn.usage)

    def _fit(self, policy: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ctx: SessionContext,
             summary: str, used: int) -> tuple[list[dict[str, Any]], SessionContext, int, tuple[int, bool]] | None:
        """The rebuilt context with the most kept turns that leave room, or None when even
        none fits under the threshold."""
        point = self.settings.compaction_threshold * self.window(policy)
        before = max(1, len(json.dumps(messages)))
        for keep in range(min(KEEP_TURNS, turns_after_task(messages)), -1, -1):
            rebuilt, new_ctx = rebuild(messages, ctx, summary, keep)
            exact = policy.count_tokens(rebuilt, tools)
            tokens = exact if exact is not None else round(used * len(json.dumps(rebuilt)) / before)
            if tokens <= TAIL_SHARE * point or (keep == 0 and tokens < point):
                return rebuilt, new_ctx, keep, (tokens, exact is None)
        return None

    def _failed(self, record: CompactionRecord, why: str, usage: Usage | None = None) -> Outcome:
        self._failed_at = record.tokens_before
        return Outcome(record.model_copy(update={"error": why}), usage=usage)

