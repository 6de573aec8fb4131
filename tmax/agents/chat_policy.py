"""A policy on any OpenAI-compatible /chat/completions endpoint (vLLM, hosted providers).

Sampling follows Vanillux2: temperature 0.7, top_p 0.95, max_tokens 16,384, top_k unset,
no tool_choice, no stop strings. The client's own retries are off: the Agent loop owns the
retry policy, so errors are mapped to the three policy exceptions instead.

max_tokens is fitted to what the server's context window leaves: the window comes from
the server's model list (vLLM reports `max_model_len`) or, failing that, from the error
a request that asked too much gets back, which also says how long the prompt was.

Cost: what the server reports with the usage (`usage.cost`, as OpenRouter sends it), else
the tokens at `prices` (US dollars per million prompt and completion tokens), else 0.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import openai

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletion, ChatCompletionMessage

from tmax.agents.parsing import message_from_text
from tmax.agents.policy import DEFAULT_MODEL_TIMEOUT_S, ContextOverflow, FatalModelError, ModelError, ModelTurn, Usage

# Substrings servers use when the prompt (plus max_tokens) does not fit the context window:
# vLLM ("maximum context length", "is too large"), OpenAI ("context_length_exceeded"),
# others ("context window", "too many tokens", "prompt is too long").
_CONTEXT_HINTS = (
    "context length",
    "context_length",
    "context window",
    "maximum context",
    "too many tokens",
    "prompt is too long",
    "input is too long",
    "max_tokens' or 'max_completion_tokens' is too large",
)


_WINDOW_RES = (re.compile(r"max_model_len\s*=\s*(\d+)"), re.compile(r"maximum context length is (\d+)"))
_PROMPT_RES = (re.compile(r"(\d+) in the messages"), re.compile(r"(\d+) input tokens"),
               re.compile(r"request has (\d+) input"))


def _first_int(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        m = pattern.search(text)
        if m:
            return int(m.group(1))
    return None


def _is_context_error(err: openai.APIStatusError) -> bool:
    text = str(err).lower()
    code = getattr(err, "code", None) or ""
    return "context_length_exceeded" in str(code) or any(h in text for h in _CONTEXT_HINTS)


def map_openai_error(err: Exception) -> Exception:
    """Map an `openai` exception onto ModelError / FatalModelError / ContextOverflow."""
    request = getattr(err, "request", None)
    where = f" at {request.url}" if request is not None else ""
    if isinstance(err, openai.APITimeoutError):
        return ModelError(f"model request{where} timed out: {err}")
    if isinstance(err, openai.APIConnectionError):
        return ModelError(f"cannot reach the model server{where}: {err}")
    if isinstance(err, openai.APIStatusError):
        status = err.status_code
        if status in (400, 413, 422) and _is_context_error(err):
            return ContextOverflow(f"context window exceeded: {err}", prompt_tokens=_first_int(_PROMPT_RES, str(err)))
        if isinstance(err, openai.AuthenticationError):
            return FatalModelError(f"authentication failed (check the API key): {err}")
        if isinstance(err, openai.PermissionDeniedError):
            return FatalModelError(f"permission denied: {err}")
        if isinstance(err, openai.NotFoundError):
            return FatalModelError(f"not found (check --model and --base-url): {err}")
        if status in (400, 422):
            return FatalModelError(f"the server rejected the request: {err}")
        # 408, 409, 429 and 5xx are transient.
        return ModelError(f"model server error {status}: {err}")
    if isinstance(err, openai.APIResponseValidationError):
        return ModelError(f"malformed model response: {err}")
    return err


def _usage(raw: CompletionUsage | None, prices: tuple[float, float] | None = None) -> Usage:
    if raw is None:
        return Usage()
    details = getattr(raw, "completion_tokens_details", None)
    usage = Usage(
        prompt_tokens=raw.prompt_tokens or 0,
        completion_tokens=raw.completion_tokens or 0,
        total_tokens=raw.total_tokens or 0,
        reasoning_tokens=(getattr(details, "reasoning_tokens", None) or 0) if details else 0,
    )
    reported = (raw.model_extra or {}).get("cost")
    if isinstance(reported, (int, float)) and not isinstance(reported, bool):
        usage.cost_usd = float(reported)
    elif prices is not None:
        usage.cost_usd = (usage.prompt_tokens * prices[0] + usage.completion_tokens * prices[1]) / 1e6
    return usage


def _check_completion(response: ChatCompletion | str, base_url: object) -> None:
    """A 200 is not always a chat completion: a proxy's HTML page comes back as text, and some
    servers put an error object in a 200. Neither gets better by asking again."""
    if isinstance(response, str):
        raise FatalModelError(f"the server at {base_url} answered 200 with something that is not a chat completion "
                              f"({response[:200]!r}); check --base-url (an OpenAI-compatible API, usually ending in /v1)")
    error = getattr(response, "error", None)
    if error:
        detail = error.get("message", error) if isinstance(error, dict) else error
        raise FatalModelError(f"the server at {base_url} answered 200 with an error: {detail}")


def openai_client(base_url: str | None, api_key: str | None, timeout: float = DEFAULT_MODEL_TIMEOUT_S) -> openai.OpenAI:
    """The client a `ChatPolicy` talks through. One may serve many policies at once (it is
    thread-safe): each new one costs ~40 ms of CPU, mostly loading the CA bundle."""
    # Local servers need no key, but the client insists on one.
    return openai.OpenAI(base_url=base_url, api_key=api_key or "dummy", timeout=timeout, max_retries=0)


class ChatPolicy:
    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        temperature: float = 0.7,
        top_p: float | None = 0.95,
        max_tokens: int = 16384,
        top_k: int | None = None,
        timeout: float = DEFAULT_MODEL_TIMEOUT_S,
        extra_body: dict[str, Any] | None = None,
        client: openai.OpenAI | None = None,
        prices: tuple[float, float] | None = None,
    ) -> None:
        """`client`: a shared `openai_client` (then base_url, api_key and timeout are its);
        `prices`: US dollars per million prompt and completion tokens, where the server
        reports no cost."""
        self.model = model
        self.prices = prices
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        if top_k is not None:
            self.extra_body["top_k"] = top_k  # not an OpenAI parameter; vLLM reads it from the body
        self.client = client or openai_client(base_url, api_key, timeout)
        self.window: int | None = None  # the server's context window in tokens, once known
        self._window_asked = False
        # Tokens of the last prompt + completion (the next prompt holds them): room left is
        # the window less this. Reset when the conversation gets shorter (a new episode).
        self._context_tokens = 0
        self._context_messages = 0

    def fitted_max_tokens(self) -> int:
        """max_tokens for the next request: the configured figure, or less when the window
        has less room left (at least 1, so an overlong prompt gets the server's own error)."""
        if self.window is None:
            return self.max_tokens
        return max(1, min(self.max_tokens, self.window - self._context_tokens))

    def _server_window(self) -> int | None:
        try:
            cards = {m.id: m.model_extra or {} for m in self.client.with_options(timeout=10).models.list()}
            card = cards.get(self.model, {})
            # A LoRA adapter's card has none: the window is its base model's (`parent`).
            value = card.get("max_model_len") or cards.get(card.get("parent"), {}).get("max_model_len")
            return int(value) if value else None
        except (openai.OpenAIError, ValueError, TypeError):
            pass  # not every server lists its models: the error messages are the fallback
        return None

    def _learn_window(self, err: openai.BadRequestError, asked: int) -> bool:
        """Take the window and prompt length from a too-many-tokens error; True when a
        smaller max_tokens would now be sent (worth a retry)."""
        text = str(err)
        window = _first_int(_WINDOW_RES, text)
        prompt = _first_int(_PROMPT_RES, text)
        if window is None:
            return False
        self.window = window
        if prompt is not None:
            self._context_tokens = prompt
        return window - self._context_tokens >= 1 and self.fitted_max_tokens() < asked

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelTurn:
        if len(messages) < self._context_messages:
            self._context_tokens = 0
        turn = self._turn(messages, tools, self.max_tokens)
        self._context_tokens = turn.usage.prompt_tokens + turn.usage.completion_tokens
        self._context_messages = len(messages)
        return turn

    # ---- Compactable (agents.compaction) ----------------------------------------------

    @property
    def context_window(self) -> int | None:
        """The server's window: asked once, before the first request where it is wanted then."""
        self._ask_window()
        return self.window

    def _ask_window(self) -> None:
        if not self._window_asked:
            self._window_asked = True
            self.window = self._server_window()

    def complete_aside(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> ModelTurn:
        """A turn that leaves the window bookkeeping as it was. Its max_tokens is fitted to
        its own request (built to fit: `agents.compaction`), not to the conversation's."""
        saved = self._context_tokens
        self._context_tokens = 0
        try:
            return self._turn(messages, tools, max_tokens)
        finally:
            self._context_tokens = saved

    def restart(self, context_tokens: int) -> None:
        self._context_tokens = context_tokens
        self._context_messages = 0

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int | None:
        return None  # an OpenAI-compatible server has no standard way to count

    def _turn(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], cap: int) -> ModelTurn:
        self._ask_window()
        kwargs: dict[str, Any] = dict(model=self.model, messages=messages, temperature=self.temperature)
        if tools:
            kwargs["tools"] = tools
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        t0 = time.monotonic()
        response = self._create(kwargs, cap)
        latency = time.monotonic() - t0
        _check_completion(response, self.client.base_url)
        if not response.choices:
            raise ModelError("the model server returned no choices")
        choice = response.choices[0]
        usage = _usage(response.usage, self.prices)
        return ModelTurn(
            message=self._message(choice.message),
            usage=usage,
            finish_reason=choice.finish_reason,
            latency_s=latency,
        )

    def _create(self, kwargs: dict[str, Any], cap: int) -> ChatCompletion:
        for attempt in range(3):
            kwargs["max_tokens"] = min(cap, self.fitted_max_tokens())
            try:
                return self.client.chat.completions.create(**kwargs)
            except openai.BadRequestError as e:
                if attempt == 2 or not self._learn_window(e, kwargs["max_tokens"]):
                    raise map_openai_error(e) from e
            except openai.OpenAIError as e:
                raise map_openai_error(e) from e
            except ValueError as e:  # a 200 whose JSON body is cut off or empty
                raise FatalModelError(f"the server at {self.client.base_url} answered 200 with a body that is not "
                                      f"valid JSON ({e}); check --base-url") from e
        raise AssertionError("unreachable")

    @staticmethod
    def _message(msg: ChatCompletionMessage) -> dict[str, Any]:
        content = msg.content or ""
        calls = [
            {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
            for tc in (msg.tool_calls or [])
            if getattr(tc, "function", None) is not None
        ]
        if not calls and "<tool_call>" in content:
            # Server started without a tool parser: parse the raw text ourselves and keep
            # the history in native shape so later requests render it as a real call.
            message = message_from_text(content)
        else:
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
        # Providers with a reasoning parser return thinking separately; keep it in history.
        reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
        if reasoning:
            message["reasoning_content"] = reasoning
        return message
