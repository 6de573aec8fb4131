"""`tmax show PATH --export messages`: saved sessions as Hugging Face chat JSONL, one line
per session: {"messages": [...], "tools": [...]}, the conversational format that chat
templates and trainers (TRL, axolotl, ...) take. Tool-call arguments become objects (HF
templates render them with `tojson`); everything else is the trajectory as the model saw it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tmax.agents.tools import TOOLS
from tmax.common.records import SessionDir

_KEEP = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw  # kept as sent: a trainer sees what the model produced
    return raw


def hf_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: message[k] for k in _KEEP if message.get(k) is not None}
    if isinstance(out.get("content"), list):  # OpenAI content parts
        out["content"] = "\n".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    out.setdefault("content", "")
    if "tool_calls" in out:
        out["tool_calls"] = [
            {"type": "function", **({"id": c["id"]} if c.get("id") else {}),
             "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in out["tool_calls"]
        ]
    return out


def session_dirs(path: Path) -> list[Path]:
    """`path` itself when it is a run directory, else every run directory below it, sorted."""
    if SessionDir(path).trajectory.is_file():
        return [path]
    return sorted(p.parent for p in path.rglob(SessionDir(path).trajectory.name))


def export_line(messages: list[dict[str, Any]]) -> str:
    return json.dumps({"messages": [hf_message(m) for m in messages], "tools": TOOLS}, ensure_ascii=False)
