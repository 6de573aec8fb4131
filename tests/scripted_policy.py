"""An in-process `Policy` that replays a script of turns, without HTTP: for unit tests of the
agent loop and the episode driver.

The turns are `scripted_server`'s (content, bash, tool_calls, reasoning_content,
finish_reason, usage, delay, status, raw, error): each becomes the chat completion that
server would send, and that completion becomes the assistant message through the same
conversion `ChatPolicy` applies to a real one. Errors are raised as `ChatPolicy` maps the
server's answers: `server`, `unavailable` and statuses 408 / 409 / 429 / 5xx are retryable
(`ModelError`), `context_length` is a `ContextOverflow`, the other canned errors, other
statuses and a `raw` body are fatal.

    policy = ScriptedPolicy([{"bash": "ls"}, {"bash": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}])
    ...
    policy.requests   # the messages of each call (compaction's summary calls among them)
    policy.close()    # a turn still waiting out its delay returns at once

It can be compacted (`agents.policy.Compactable`): the summary call takes the next turn of the
script like any other (`aside` lists which calls they were, with the max_tokens asked), and
`window` is the context window it reports.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

from openai.types.chat import ChatCompletion
from scripted_server import completion_body

from tmax.agents.chat_policy import ChatPolicy
from tmax.agents.policy import ContextOverflow, FatalModelError, ModelError, ModelTurn, Usage

RETRYABLE = {"server", "unavailable"}
RETRYABLE_STATUS = {408, 409, 429}


class ScriptedPolicy:
    def __init__(self, script: list[dict[str, Any]], model: str = "scripted-model", window: int | None = None) -> None:
        self.script = list(script)
        self.model = model
        self.window = window
        self.requests: list[list[dict[str, Any]]] = []
        self.aside: list[tuple[int, int]] = []  # (request index, max_tokens) of each summary call
        self.restarts: list[int] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelTurn:
        with self._lock:
            index = len(self.requests)
            self.requests.append(copy.deepcopy(messages))
        if index >= len(self.script):
            raise FatalModelError(f"scripted policy: script exhausted after {index} turns")
        turn = self.script[index]
        t0 = time.monotonic()
        if turn.get("delay"):
            self._closed.wait(float(turn["delay"]))
        _raise_error(turn)
        body = completion_body(turn, self.model, {"messages": messages}, index)
        choice = ChatCompletion.model_validate(body).choices[0]
        u = body["usage"]
        usage = Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                      total_tokens=u["total_tokens"])
        return ModelTurn(message=ChatPolicy._message(choice.message), usage=usage, finish_reason=choice.finish_reason,
                         latency_s=time.monotonic() - t0)

    @property
    def context_window(self) -> int | None:
        return self.window

    def complete_aside(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int) -> ModelTurn:
        self.aside.append((len(self.requests), max_tokens))
        return self.complete(messages, tools)

    def restart(self, context_tokens: int) -> None:
        self.restarts.append(context_tokens)

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int | None:
        return None

    def close(self) -> None:
        self._closed.set()


def _raise_error(turn: dict[str, Any]) -> None:
    if "error" in turn:
        name = turn["error"]
        if name == "context_length":
            raise ContextOverflow(f"scripted: context window exceeded ({name})")
        raise (ModelError if name in RETRYABLE else FatalModelError)(f"scripted error: {name}")
    if "status" in turn:
        status = int(turn["status"])
        retry = status in RETRYABLE_STATUS or status >= 500
        raise (ModelError if retry else FatalModelError)(f"scripted error status {status}")
    if "raw" in turn:
        raise FatalModelError("scripted: a 200 that is not a chat completion")
