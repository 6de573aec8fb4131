"""Tool-call parsing: from an assistant message to the one action the loop runs.

Three shapes are understood:

* native OpenAI `tool_calls` (what vLLM returns with `--enable-auto-tool-choice` and the
  `qwen3_xml` or `hermes` parser, or any hosted provider);
* raw Qwen3.5 / qwen3_xml text::

      <tool_call>
      <function=bash>
      <parameter=command>
      ls -la
      </parameter>
      </function>
      </tool_call>

* raw hermes JSON text: `<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>`.

Token-level policies only have raw text, and chat servers started without a tool parser
return raw text in `content`; both go through `parse_text`.

Vanillux2 rules: only the first call is used; a non-`bash` name, no call at all, or
arguments that are not a JSON object are format errors; the command is stripped; a command
containing the submit marker is a submit (it still runs).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tmax.agents.prompts import SUBMIT_MARKER
from tmax.agents.tools import BASH_TOOL_NAME

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_CLOSE = "</think>"

# A block runs to its closing tag, or to the end of the text when generation stopped early.
_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.S)
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>")
# A parameter ends at its closing tag, or (lenient, like vLLM's qwen3_xml parser) where the
# next parameter or the end of the function starts.
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.S)


@dataclass(frozen=True)
class Action:
    """What the loop should do with one assistant message."""

    command: str | None = None  # the stripped bash command; None on a format error
    tool_call_id: str | None = None  # id of the call answered by the observation / feedback
    submit: bool = False  # the command contains the submit marker
    error: str | None = None  # why this is a format error (for logs); None if valid

    @property
    def is_format_error(self) -> bool:
        return self.error is not None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _xml_call(body: str) -> dict[str, Any] | None:
    m = _FUNCTION_RE.search(body)
    if m is None:
        return None
    name = m.group(1).strip()
    args: dict[str, Any] = {}
    for pm in _PARAM_RE.finditer(body, m.end()):
        value = pm.group(2)
        # The format puts the value on its own lines: drop exactly one newline each side.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[pm.group(1).strip()] = value
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _json_call(body: str) -> dict[str, Any]:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        # Keep the raw text so the record shows what the model wrote; the empty name and
        # non-JSON arguments make it a format error downstream.
        return {"type": "function", "function": {"name": "", "arguments": body}}
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"type": "function", "function": {"name": obj["name"], "arguments": args}}


def parse_text(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split raw model text into (content, tool calls).

    Content is the text before the first `<tool_call>` (thinking included), with trailing
    whitespace removed; calls are OpenAI-shaped dicts without ids. Calls are searched for
    after the last `</think>` so a call the model only *thought about* is not run."""
    search_from = text.rfind(THINK_CLOSE)
    search_from = 0 if search_from < 0 else search_from + len(THINK_CLOSE)
    calls: list[dict[str, Any]] = []
    first_start: int | None = None
    for m in _BLOCK_RE.finditer(text, search_from):
        if first_start is None:
            first_start = m.start()
        body = m.group(1)
        call = _xml_call(body) if "<function=" in body else _json_call(body)
        if call is not None:
            calls.append(call)
    if first_start is None:
        return text, []
    return text[:first_start].rstrip(), calls


def message_from_text(text: str) -> dict[str, Any]:
    """An assistant message (native shape, ids assigned) from raw model text."""
    content, calls = parse_text(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": new_call_id(), **c} for c in calls]
    return message


def _arguments(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None
    return None


def parse_action(message: dict[str, Any]) -> Action:
    """The Vanillux2 action for an assistant message.

    The bad call's id is kept only when the call itself is well-formed (valid JSON
    arguments), so that the feedback can go back as a `tool` reply without making the
    conversation unsendable."""
    calls = message.get("tool_calls") or []
    if not calls:
        # Servers without a tool parser leave the call as raw text in content.
        _, calls = parse_text(message.get("content") or "")
        if not calls:
            return Action(error="no tool call")
    first = calls[0]
    fn = first.get("function") or {}
    call_id = first.get("id")
    args = _arguments(fn.get("arguments"))
    if args is None:
        return Action(error="tool call arguments are not a JSON object")
    name = fn.get("name")
    if name != BASH_TOOL_NAME:
        return Action(error=f"unknown tool {name!r}", tool_call_id=call_id)
    command = args.get("command")
    if not isinstance(command, str):
        return Action(error="the bash call has no string `command`", tool_call_id=call_id)
    command = command.strip()
    if not command:
        return Action(error="the bash command is empty", tool_call_id=call_id)
    return Action(command=command, tool_call_id=call_id, submit=SUBMIT_MARKER in command)
