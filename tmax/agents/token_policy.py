"""A policy that works in token ids, for RL: the trainer sees exactly what the sampler saw.

The prompt ([system, user] + tools) is rendered with the tokenizer's chat template once.
After that the context only grows:

* sampled ids are appended verbatim (mask 1, the sampler's logprobs);
* each message the Agent added since (tool observation, format-error feedback, user
  guidance) is appended as the chat template's rendering of just that message, plus the
  next assistant generation prompt (mask 0, logprob 0).

History is never re-rendered, so a template that rewrites earlier turns (e.g. drops old
thinking) cannot make the trained sequence differ from the sampled one.

Budgets follow the Tmax RL recipe: a prompt limit (2,048), a response budget counting
model *and* tool tokens (65,536), a context limit (prompt 2,048 + 65,536), and a per-turn
cap (16,384); each turn samples at most max(1, min(remaining response, remaining context,
per-turn cap)). When a budget is used up, or the prompt is over its limit, the policy
raises ContextOverflow and the episode ends cleanly.

Compaction (`agents.compaction`) cuts the record into segments: the summary is sampled aside
(`complete_aside`: on the summary request rendered as a prompt, recorded nowhere), then `restart` closes
the trace into `segments` and the next turn renders the rebuilt messages as a new prompt.
Each segment is a trace of its own (prompt ids as sent, completions as sampled), and the
budgets count per segment; the prompt limit applies to the first.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tmax.agents.parsing import message_from_text
from tmax.agents.policy import ContextOverflow, ModelTurn, SampledTokens, TokenSampler, TokenTrace, Usage

# A stand-in conversation to render new messages against. Its assistant content is an
# anchor: everything after the end-of-turn token that closes it is the new messages'
# rendering (plus the generation prompt), whatever the template does to earlier turns.
_ANCHOR = "TMAX-DELTA-ANCHOR"
_BASE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": _ANCHOR},
]


def _as_served(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with tool-call arguments that are JSON objects as mappings, as vLLM hands
    them to a chat template (an XML template iterates them): for renderings that are not
    recorded (a count, a summary request)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {})
                try:
                    parsed = json.loads(function.get("arguments") or "")
                except (TypeError, ValueError):
                    parsed = None
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
                fixed.append({**call, "function": function})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


class TokenPolicy:
    # The Agent's own context guard defers to the budgets enforced here.
    enforces_context_budget = True

    def __init__(
        self,
        sampler: TokenSampler,
        tokenizer: Any,
        *,
        temperature: float = 0.7,
        top_p: float = 0.95,
        max_response_tokens: int = 65536,
        max_context_tokens: int = 2048 + 65536,
        max_turn_tokens: int = 16384,
        max_prompt_tokens: int | None = None,
        seed: int | None = None,
        end_of_turn: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_response_tokens = max_response_tokens
        self.max_context_tokens = max_context_tokens
        self.max_turn_tokens = max_turn_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.template_kwargs = dict(chat_template_kwargs or {})
        # The token that ends an assistant turn (Qwen: <|im_end|>, the tokenizer's eos).
        self.end_of_turn = end_of_turn or tokenizer.eos_token
        if not self.end_of_turn:
            raise ValueError("the tokenizer has no eos token; pass end_of_turn= explicitly")
        eot_ids = tokenizer.encode(self.end_of_turn, add_special_tokens=False)
        if len(eot_ids) != 1:
            raise ValueError(f"end-of-turn {self.end_of_turn!r} is not a single token: {eot_ids}")
        self.end_of_turn_id = eot_ids[0]
        self._stop_ids = {self.end_of_turn_id}
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self._stop_ids.add(tokenizer.eos_token_id)
        self.trace = TokenTrace()
        self.segments: list[TokenTrace] = []  # traces that compactions closed, in order
        self._tools: list[dict[str, Any]] | None = None
        self._seen = 0  # messages already in the token context
        self._unsampled = False  # the context holds new messages that no sample has answered yet

    # ---- rendering --------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self._tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def delta_text(self, new_messages: list[dict[str, Any]]) -> str:
        """The template's rendering of `new_messages` after an assistant turn, from just
        after that turn's end-of-turn token up to and including the next generation prompt."""
        text = self._render(_BASE + list(new_messages), generation_prompt=True)
        anchor = text.rfind(_ANCHOR)
        end = text.find(self.end_of_turn, anchor) if anchor >= 0 else -1
        if end < 0:
            raise RuntimeError("the chat template does not end assistant turns with the end-of-turn token")
        return text[end + len(self.end_of_turn) :]

    # ---- Policy -----------------------------------------------------------------------

    def _new_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of the messages after the ones already in the context."""
        new = messages[self._seen :]
        # Skip our own last assistant message (the Agent appends it, maybe edited).
        if new and new[0].get("role") == "assistant":
            new = new[1:]
        if not new:
            raise RuntimeError("TokenPolicy.complete() called with no new message since the last turn")
        if any(m.get("role") == "assistant" for m in new):
            raise RuntimeError("TokenPolicy cannot take assistant messages it did not sample")
        ids = self._encode(self.delta_text(new))
        if not self.trace.ids or self.trace.ids[-1] != self.end_of_turn_id:
            # The last turn was cut by the token cap: close it as the template would.
            ids = [self.end_of_turn_id] + ids
        return ids

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelTurn:
        trace = self.trace
        if self._unsampled and len(messages) == self._seen:
            # A retry after a failed sample: the context is already in place.
            pass
        elif not trace.prompt_ids:
            self._tools = list(tools)
            trace.prompt_ids = self._encode(self._render(messages, generation_prompt=True))
            limit = self.max_prompt_tokens if not self.segments else None  # a rebuilt context is no task prompt
            if limit is not None and len(trace.prompt_ids) > limit:
                raise ContextOverflow(f"the prompt has {len(trace.prompt_ids)} tokens, over the limit of {limit}")
        else:
            ids = self._new_ids(messages)
            if len(ids) > self._remaining():
                raise ContextOverflow(f"the next observation ({len(ids)} tokens) does not fit the token budget")
            trace.extend(ids, None, trainable=False)
        self._seen = len(messages)
        self._unsampled = True

        remaining = self._remaining()
        if remaining <= 0:
            raise ContextOverflow("the token budget is used up")
        turn, out = self._sample(trace.context, max(1, min(remaining, self.max_turn_tokens)))
        trace.extend(list(out.ids), list(out.logprobs), trainable=True)
        trace.turn_versions.append(out.policy_version)
        self._unsampled = False
        return turn

    def _sample(self, context: list[int], max_tokens: int) -> tuple[ModelTurn, SampledTokens]:
        t0 = time.monotonic()
        out = self.sampler.sample(context, max_tokens, self.temperature, self.top_p, self.seed)
        latency = time.monotonic() - t0
        ids = list(out.ids)
        if len(out.logprobs) != len(ids):
            raise ValueError(f"sampler returned {len(ids)} ids but {len(out.logprobs)} logprobs")
        body = ids[:-1] if ids and ids[-1] in self._stop_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        usage = Usage(prompt_tokens=len(context), completion_tokens=len(ids), total_tokens=len(context) + len(ids))
        return ModelTurn(message=message_from_text(text), usage=usage, finish_reason=out.finish_reason,
                         latency_s=latency), out

    def fork(self, seed: int | None) -> TokenPolicy:
        """A policy that continues from this one's token context as it is (the trace copied: a
        branch shares the prefix's ids exactly), sampling with `seed`."""
        import copy

        other = copy.copy(self)
        other.seed = seed
        other.trace = copy.deepcopy(self.trace)
        other.segments = list(self.segments)
        other._tools = list(self._tools) if self._tools is not None else None
        return other

    # ---- Compactable (agents.compaction) ----------------------------------------------

    @property
    def context_window(self) -> int | None:
        return self.max_context_tokens

    def complete_aside(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> ModelTurn:
        """A turn on `messages` rendered as a prompt of their own, recorded nowhere: a summary
        request is built to fit the window (long outputs clipped, or a piece of the
        conversation), so it is not the token context plus a message."""
        saved, self._tools = self._tools, list(tools)
        try:
            context = self._encode(self._render(_as_served(messages), generation_prompt=True))
        finally:
            self._tools = saved if saved is not None else self._tools
        room = self.max_context_tokens - len(context)
        if room <= 0:
            raise ContextOverflow(f"the request ({len(context)} tokens) does not fit the context of {self.max_context_tokens}")
        return self._sample(context, min(room, max_tokens))[0]

    def restart(self, context_tokens: int) -> None:
        """Close the trace into `segments`; the next turn renders its messages as a new prompt."""
        if self.trace.prompt_ids:
            self.segments.append(self.trace)
        self.trace = TokenTrace()
        self._seen = 0
        self._unsampled = False

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int | None:
        saved, self._tools = self._tools, list(tools)
        try:
            return len(self._encode(self._render(_as_served(messages), generation_prompt=True)))
        finally:
            self._tools = saved

    def _remaining(self) -> int:
        """Tokens that may still be added: the smaller of the response and context budgets."""
        response_left = self.max_response_tokens - len(self.trace.ids)
        context_left = self.max_context_tokens - len(self.trace.prompt_ids) - len(self.trace.ids)
        return min(response_left, context_left)
