"""Compaction: a long session goes on past its context window on a summary the model writes.

Before each model call the loop (`agents.loop.Agent`) counts the request about to go out
(`agents.fitting.TokenCounter`: the policy's tokenizer, else characters at the ratio the
server's last usage gave). When it would reach `compaction_threshold` of the window
(`Compactor.window`: the smaller of `context_budget` and the server's window), when the user
asks (`/compact [focus]`), or when the server refused the request as too long anyway
(`overflow`: then the same turn is tried again, once), it compacts first:

1. the model is sent the conversation plus `SUMMARY_PROMPT` (the task, what was done, the
   state of the files and the shell, open items; the user's focus when given) and answers in
   a turn aside (`policy.Compactable.complete_aside`: no part of a token policy's record, so
   the summary is not a training sample). That request is built to fit the window with room
   for the summary (`_Summariser`): as it is where it fits; else with its long messages cut
   to head and tail (never the task or a follow-up); else in pieces, oldest turns first, each
   piece's request holding the task, the follow-ups and the summary so far;
2. the context is rebuilt (`rebuild`): the system prompt; one user message holding the task
   as first given and every follow-up the user typed, verbatim, then the summary; then the
   last `KEEP_TURNS` turns verbatim (fewer, or none, where they would leave the rebuilt
   context over `TAIL_SHARE` of the threshold);
3. the policy restarts on the rebuilt messages (a token policy starts a new segment: each
   segment's prompt ids are the rebuilt context exactly as sent).

One output larger than a compacted context leaves room for (`Compactor.observation_room`)
is cut by the loop to its head and tail. Only a context whose system prompt, task and
follow-ups alone leave no room (`Compactor.too_large`) ends the episode at the window.

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

from tmax.agents.fitting import Clip, TokenCounter, clip_message, clip_text
from tmax.agents.policy import Compactable, ContextOverflow, FatalModelError, ModelError, ModelTurn, Policy, Usage
from tmax.agents.prompts import render
from tmax.agents.agent_settings import AgentSettings

KEEP_TURNS = 2  # turns (an assistant message and what answered it) kept verbatim
TAIL_SHARE = 0.5  # kept turns only while the rebuilt context stays under this share of the threshold
RETRY_GROWTH = 0.05  # after a failure, automatic compaction waits for this share of the window more
SUMMARY_MAX_TOKENS = 4096  # the summary's cap, and at most an eighth of the window
SUMMARY_MIN_TOKENS = 256
SUMMARY_FLOOR_TOKENS = 64  # the least a summary may take where the task and the rest leave little room
MIN_OBSERVATION_TOKENS = 64  # an observation is never cut to less than this
SUMMARY_ATTEMPTS = 3  # a summary request the server still finds too long is rebuilt smaller, this often

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
    reason: Literal["auto", "manual", "overflow"]  # overflow: the server refused a request as too long
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
    clipped: list[Clip] = Field(default_factory=list)  # texts the summary request cut to fit the window
    pieces: int = 1  # summary calls: more than one when the conversation was summarised in pieces


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
    """When to compact (`due`) and how (`compact`), for one session; how much room an
    observation has (`observation_room`) and why a context cannot be made to fit (`too_large`)."""

    def __init__(self, settings: AgentSettings, counter: TokenCounter | None = None) -> None:
        self.settings = settings
        self.counter = counter or TokenCounter()
        self._failed_at: int | None = None  # context tokens at the last failure

    def window(self, policy: Policy) -> int:
        known = policy.context_window if isinstance(policy, Compactable) else None
        return min(self.settings.context_budget, known) if known else self.settings.context_budget

    def summary_cap(self, window: int) -> int:
        """The summary's max_tokens: at most an eighth of the window (at least SUMMARY_MIN_TOKENS)."""
        return min(self.settings.max_tokens, SUMMARY_MAX_TOKENS, max(SUMMARY_MIN_TOKENS, window // 8))

    def active(self, policy: Policy) -> bool:
        return self.settings.compaction and isinstance(policy, Compactable)

    def due(self, policy: Policy, used: int) -> bool:
        """Automatic compaction: on, possible with this policy, and the request past the threshold."""
        if not self.active(policy):
            return False
        window = self.window(policy)
        point = self.settings.compaction_threshold * window
        if self._failed_at is not None:
            point = max(point, self._failed_at + RETRY_GROWTH * window)
        return used >= point

    def use(self, policy: Policy, used: int, compactions: int) -> ContextUse:
        threshold = self.settings.compaction_threshold if self.settings.compaction else None
        return ContextUse(used, self.window(policy), threshold, compactions)

    def _count(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        return self.counter.count(policy, messages, tools).tokens

    def observation_room(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                         ctx: SessionContext) -> int | None:
        """The most tokens one observation may take (None: compaction off, no limit): what a
        compacted context (system prompt, task, follow-ups, summary) leaves under the
        threshold, and at most half the window."""
        if not self.active(policy):
            return None
        window = self.window(policy)
        fixed = self._count(policy, rebuild(messages, ctx, "", 0)[0], tools)
        room = int(self.settings.compaction_threshold * window) - fixed - self.summary_cap(window)
        return max(MIN_OBSERVATION_TOKENS, min(window // 2, room))

    def too_large(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  ctx: SessionContext) -> str | None:
        """Why no compaction can make this context fit (the system prompt, the task and the
        follow-ups alone leave no room for a summary and a reply), or None when one can."""
        window = self.window(policy)
        fixed, _ = rebuild(messages, ctx, "", 0)
        total = self._count(policy, fixed, tools)
        if total + 2 * SUMMARY_MIN_TOKENS <= window:
            return None
        first = _first_user(messages)
        task = _text(ctx.task or messages[first])
        follow_ups = [*ctx.follow_ups, *(_text(messages[i]) for i in ctx.follow_up_at if i < len(messages))]
        parts = {"system prompt": self._count(policy, fixed[:first], tools),
                 "task": self._count(policy, [{"role": "user", "content": task}], []),
                 "follow-ups": self._count(policy, [{"role": "user", "content": f} for f in follow_ups], [])
                 if follow_ups else 0}
        largest = max(parts, key=lambda k: parts[k])
        listed = ", ".join(f"{name} {n:,}" for name, n in parts.items() if n)
        return (f"the context cannot be made to fit the model's {window:,}-token window: the system prompt (with the "
                f"project instructions and the tools), the task and the follow-ups alone are about {total:,} tokens "
                f"({listed}), leaving no room for a summary and a reply. The largest part is the {largest}: shorten it")

    def compact(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ctx: SessionContext,
                used: int, *, step: int, reason: Literal["auto", "manual", "overflow"], focus: str | None,
                ask: Callable[[list[dict[str, Any]], int], ModelTurn]) -> Outcome:
        """Summarise and rebuild; `ask(messages, max_tokens)` is the summary call (with the
        loop's retries). A failure leaves `messages` as they are (`Outcome.messages` None)."""
        window = self.window(policy)
        record = CompactionRecord(segment=ctx.segments + 1, step=step, reason=reason, ok=False, tokens_before=used,
                                  window=window, focus=focus or None)
        if not isinstance(policy, Compactable):
            return self._failed(record, "this model policy cannot compact a session")
        summariser = _Summariser(self, policy, messages, tools, ctx, focus, ask)
        if turns_after_task(messages) == 0:
            # Nothing new since the last compaction; after the server refused its context as
            # too long (its count is higher than ours), that context is rebuilt tighter.
            summary = next((c.summary for c in reversed(ctx.compactions) if c.ok), None) if reason == "overflow" else None
            if summary is None:
                return self._failed(record, "nothing to compact yet: the model has not answered")
        else:
            try:
                summary = summariser.run()
            except (ModelError, FatalModelError, ContextOverflow) as e:
                return self._failed(record, f"the summary call failed: {e}", summariser.usage)
            except KeyboardInterrupt:
                return self._failed(record, "the summary call was interrupted", summariser.usage)
        record = record.model_copy(update=dict(summary=summary, summary_tokens=summariser.usage.completion_tokens,
                                               clipped=summariser.clipped, pieces=summariser.pieces,
                                               window=self.window(policy)))
        if not summary:
            return self._failed(record, "the model's summary was empty", summariser.usage)
        fitted = self._fit(policy, messages, tools, ctx, summary) or self._fit_shorter(policy, messages, tools, ctx,
                                                                                        record)
        if fitted is None:
            return self._failed(record, "the summary is too long: the rebuilt context would still be over "
                                        f"{self.settings.compaction_threshold:.0%} of the window", summariser.usage)
        rebuilt, new_ctx, keep, (tokens, estimated) = fitted
        self._failed_at = None
        record = record.model_copy(update=dict(ok=True, tokens_after=tokens, estimated=estimated, kept_turns=keep,
                                               follow_ups=len(new_ctx.follow_ups), prefix=_first_user(rebuilt) + 1,
                                               kept_messages=len(rebuilt) - _first_user(rebuilt) - 1))
        new_ctx.compactions.append(record)
        return Outcome(record, rebuilt, new_ctx, summariser.usage)

    def _fit_shorter(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     ctx: SessionContext, record: CompactionRecord,
                     ) -> tuple[list[dict[str, Any]], SessionContext, int, tuple[int, bool]] | None:
        """`_fit` with the summary cut (head and tail kept) until the rebuilt context fits,
        as long as some of it stays; the record gets the summary as kept and lists the cut.
        None: it never fits."""
        window = self.window(policy)
        summary = record.summary
        for _ in range(4):
            over = self._count(policy, rebuild(messages, ctx, summary, 0)[0], tools) - int(
                self.settings.compaction_threshold * window * 0.9)
            keep = len(summary) - self.counter.chars_for(max(over, 1))
            if keep < 200:
                return None
            summary = clip_text(summary, keep)[0]
            fitted = self._fit(policy, messages, tools, ctx, summary)
            if fitted is not None:
                record.clipped.append(Clip(where="the summary", chars=len(record.summary), kept=keep))
                record.summary = summary
                return fitted
        return None

    def _fit(self, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ctx: SessionContext,
             summary: str) -> tuple[list[dict[str, Any]], SessionContext, int, tuple[int, bool]] | None:
        """The rebuilt context with the most kept turns that leave room, or None when even
        none fits under the threshold (or, where the system prompt, the task and the
        follow-ups take most of the threshold, leaves room for a reply in the window)."""
        window = self.window(policy)
        point = self.settings.compaction_threshold * window
        for keep in range(min(KEEP_TURNS, turns_after_task(messages)), -1, -1):
            rebuilt, new_ctx = rebuild(messages, ctx, summary, keep)
            count = self.counter.count(policy, rebuilt, tools)
            if count.tokens <= TAIL_SHARE * point or (keep == 0 and (count.tokens < point or count.tokens
                                                                     + 2 * SUMMARY_MIN_TOKENS <= window)):
                return rebuilt, new_ctx, keep, (count.tokens, count.estimated)
        return None

    def _failed(self, record: CompactionRecord, why: str, usage: Usage | None = None) -> Outcome:
        self._failed_at = record.tokens_before
        return Outcome(record.model_copy(update={"error": why}), usage=usage)


class _Summariser:
    """The summary calls of one compaction, each built to fit the window with room for the
    summary: the conversation as it is where it fits; else with its long messages clipped
    (head and tail kept; never the task or a follow-up); else in pieces, oldest turns first,
    each piece's call holding the summary so far, the last one's answer the summary. A
    request the server still refuses as too long is rebuilt smaller (SUMMARY_ATTEMPTS)."""

    def __init__(self, compactor: Compactor, policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 ctx: SessionContext, focus: str | None, ask: Callable[[list[dict[str, Any]], int], ModelTurn]) -> None:
        self.compactor, self.policy, self.messages, self.tools, self.ctx = compactor, policy, messages, tools, ctx
        self.prompt = {"role": "user", "content": summary_prompt(focus)}
        self.ask = ask
        self.usage = Usage()
        self.follow_ups = {id(messages[i]) for i in ctx.follow_up_at if i < len(messages)}  # never clipped
        self.clipped: list[Clip] = []
        self.pieces = 0
        self.sent: list[dict[str, Any]] = []  # the last summary request

    def _fits(self, request: list[dict[str, Any]], budget: int) -> bool:
        return self.compactor._count(self.policy, request, self.tools) <= budget

    def _call(self, request: list[dict[str, Any]], cap: int) -> str:
        self.sent = request
        turn = self.ask(request, cap)
        self.usage.add(turn.usage)
        self.pieces += 1
        return _THINK.sub("", _text(turn.message)).strip()

    def run(self) -> str:
        first = _first_user(self.messages)
        shrink = 1.0  # of the room for the conversation, after a refusal that did not say by how much
        for attempt in range(1, SUMMARY_ATTEMPTS + 1):
            window = self.compactor.window(self.policy)  # the server may have told a smaller one
            margin = max(16, window // 32)
            # The fixed part (system prompt, task, follow-ups, the prompt) is sent whatever happens;
            # of what it leaves, the summary may take a third, so that a piece's request (the fixed
            # part, the summary so far, some turns) still has room for a turn.
            fixed = self.compactor._count(self.policy, [*self._head(first, ""), self.prompt], self.tools)
            cap = max(SUMMARY_FLOOR_TOKENS, min(self.compactor.summary_cap(window), (window - margin - fixed) // 3))
            budget = fixed + int((window - cap - margin - fixed) * shrink)
            try:
                return self._within(budget, cap)
            except ContextOverflow as e:
                if attempt == SUMMARY_ATTEMPTS:
                    raise
                if e.prompt_tokens and self.sent:  # the server's count: estimate by it from now on
                    self.compactor.counter.calibrate(self.sent, self.tools, e.prompt_tokens)
                else:
                    shrink *= 0.6
        raise AssertionError("unreachable")

    def _within(self, budget: int, cap: int) -> str:
        self.clipped, self.pieces = [], 0
        if self._fits([*self.messages, self.prompt], budget):
            return self._call([*self.messages, self.prompt], cap)
        first = _first_user(self.messages)
        limit = self.compactor.counter.chars_for(max(MIN_OBSERVATION_TOKENS, budget // 8))
        body = [self._clip(i, limit) for i in range(first + 1, len(self.messages))]
        if self._fits([*self.messages[:first + 1], *body, self.prompt], budget):
            return self._call([*self.messages[:first + 1], *body, self.prompt], cap)
        return self._in_pieces(first, body, budget, cap, limit)

    def _clip(self, index: int, limit: int) -> dict[str, Any]:
        message = self.messages[index]
        if id(message) in self.follow_ups:
            return message
        clipped, cut = clip_message(message, limit)
        if cut:
            size = len(_text(message)) + len(json.dumps(message.get("tool_calls") or ""))
            self.clipped.append(Clip(where=f"message {index} ({message.get('role')})", chars=size, kept=size - cut))
        return clipped

    def _head(self, first: int, summary: str) -> list[dict[str, Any]]:
        """A piece's start: the system prompt, the task and every follow-up verbatim, the summary
        so far (at first the last compaction's, which the task message carried)."""
        follow_ups = [*self.ctx.follow_ups, *(_text(self.messages[i]) for i in self.ctx.follow_up_at
                                              if i < len(self.messages))]
        task = _text(self.ctx.task or self.messages[first])
        text = carried_message(task, follow_ups, summary or "(none yet: this is the first part)")
        return [*self.messages[:first], {"role": "user", "content": text}]

    def _in_pieces(self, first: int, body: list[dict[str, Any]], budget: int, cap: int, limit: int) -> str:
        turns: list[list[dict[str, Any]]] = []
        for message in body:  # a turn: an assistant message and what answered it
            if not turns or message.get("role") == "assistant":
                turns.append([])
            turns[-1].append(message)
        previous = next((c.summary for c in reversed(self.ctx.compactions) if c.ok), "")
        summary, chunk = self._capped(previous, cap), []
        for i, turn in enumerate(turns):
            if chunk and not self._fits([*self._head(first, summary), *chunk, *turn, self.prompt], budget):
                summary, chunk = self._call([*self._head(first, summary), *chunk, self.prompt], cap), []
                summary = self._capped(summary, cap)
            turn = self._shrunk(self._head(first, summary), turn, budget, limit)
            chunk.extend(turn)
        return self._call([*self._head(first, summary), *chunk, self.prompt], cap)

    def _capped(self, summary: str, cap: int) -> str:
        """The summary so far, which goes into every later piece: at most `cap` tokens as
        counted (text the model wrote may take more tokens to read than it sampled)."""
        kept, keep = summary, len(summary)
        while keep > 100 and self.compactor._count(self.policy, [{"role": "user", "content": kept}], []) > cap:
            keep = int(keep * 0.7)
            kept = clip_text(summary, keep)[0]
        return kept

    def _shrunk(self, head: list[dict[str, Any]], turn: list[dict[str, Any]], budget: int,
                limit: int) -> list[dict[str, Any]]:
        """One turn clipped harder until it fits beside `head`, at the last down to the notes
        of what was cut (then, if the estimate still says no, the server decides: a refusal
        with its count corrects the estimate and the summary is tried again)."""
        while limit > 0 and not self._fits([*head, *turn, self.prompt], budget):
            limit = limit // 2 if limit >= 80 else 0
            turn = [m if id(m) in self.follow_ups else clip_message(m, limit)[0] for m in turn]
        return turn
