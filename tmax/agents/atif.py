"""ATIF (Harbor's Agent Trajectory Interchange Format, v1.x) from a saved run, and back.

A run's chat messages map to ATIF steps:

* `system` / the first `user` message      -> a `system` / `user` step;
* an `assistant` message                    -> an `agent` step (message, reasoning, tool calls);
* a `tool` message, or a `user` message that answers an action given as text (mini-swe,
  terminus-2: no tool call)                 -> that agent step's observation;
* any other `user` message (guidance, a follow-up task) -> a `user` step.

Per-step timing (`timing.json`) goes to each agent step's `extra`; the run's token totals to
`final_metrics`. `from_atif` turns a trajectory back into chat messages for `tmax show`.

In a bench trial's agent/ the ATIF is `trajectory.json` (the path Harbor's viewer and
tools read) and the chat messages, exactly as sent, move to `messages.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tmax.common.records import StepTiming

SCHEMA_VERSION = "ATIF-v1.6"
ATIF_FILE = "trajectory.atif.json"  # where bench trials kept the ATIF before it took trajectory.json


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]] | None:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or {})
        except json.JSONDecodeError:
            args = {"raw": raw}
        if not isinstance(args, dict):
            args = {"value": args}
        calls.append({"tool_call_id": call.get("id") or f"call_{len(calls)}", "function_name": fn.get("name") or "",
                      "arguments": args})
    return calls or None


def _observe(step: dict[str, Any], content: str, call_id: str | None) -> None:
    results = step.setdefault("observation", {"results": []})["results"]
    results.append({"source_call_id": call_id, "content": content})


def to_atif(messages: list[dict[str, Any]], timing: list[StepTiming], usage: dict[str, Any], *,
            agent_name: str, agent_version: str, model_name: str | None = None, session_id: str | None = None,
            tools: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ATIF document (a JSON-ready dict) for one run's saved files."""
    steps: list[dict[str, Any]] = []
    timing_by_step = {t.step: t for t in timing if t.step is not None}
    last_agent: dict[str, Any] | None = None
    answered = True  # whether the last agent step's action already has its observation
    n_agent = 0
    for msg in messages:
        role, content = msg.get("role"), _text(msg.get("content"))
        if role == "assistant":
            n_agent += 1
            step: dict[str, Any] = {"step_id": len(steps) + 1, "source": "agent", "message": content}
            if model_name:
                step["model_name"] = model_name
            if msg.get("reasoning_content"):
                step["reasoning_content"] = msg["reasoning_content"]
            calls = _tool_calls(msg)
            if calls:
                step["tool_calls"] = calls
            if n_agent in timing_by_step:
                step["extra"] = {"timing": timing_by_step[n_agent].model_dump(exclude_defaults=True)}
            steps.append(step)
            last_agent, answered = step, False
        elif role == "tool" and last_agent is not None:
            ids = {c["tool_call_id"] for c in last_agent.get("tool_calls") or []}
            call_id = msg.get("tool_call_id")
            _observe(last_agent, content, call_id if call_id in ids else None)
            answered = True
        elif role == "user" and last_agent is not None and not answered and not last_agent.get("tool_calls"):
            _observe(last_agent, content, None)
            answered = True
        else:
            source = "system" if role == "system" else "user"
            steps.append({"step_id": len(steps) + 1, "source": source, "message": content})
    agent: dict[str, Any] = {"name": agent_name, "version": agent_version}
    if model_name:
        agent["model_name"] = model_name
    if tools:
        agent["tool_definitions"] = tools
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "agent": agent, "steps": steps}
    if session_id:
        doc["session_id"] = session_id
    doc["final_metrics"] = {
        "total_prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "total_completion_tokens": int(usage.get("completion_tokens") or 0),
        "total_steps": len(steps),
    }
    if extra:
        doc["extra"] = extra
    return doc


def from_atif(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages from an ATIF document: observations of a tool call become `tool`
    messages, other observations `user` messages."""
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list):
        raise ValueError("not an ATIF trajectory (no steps)")
    messages: list[dict[str, Any]] = []
    for step in doc["steps"]:
        source, content = step.get("source"), _text(step.get("message"))
        if source != "agent":
            messages.append({"role": "system" if source == "system" else "user", "content": content})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if step.get("tool_calls"):
            msg["tool_calls"] = [{"id": c["tool_call_id"], "type": "function",
                                  "function": {"name": c["function_name"], "arguments": json.dumps(c["arguments"])}}
                                 for c in step["tool_calls"]]
        messages.append(msg)
        for res in (step.get("observation") or {}).get("results") or []:
            text = _text(res.get("content"))
            if res.get("source_call_id"):
                messages.append({"role": "tool", "tool_call_id": res["source_call_id"], "content": text})
            else:
                messages.append({"role": "user", "content": text})
    return messages


def write_atif(run_dir: Path, *, agent_name: str, agent_version: str, model_name: str | None = None,
               session_id: str | None = None, tools: list[dict[str, Any]] | None = None) -> Path | None:
    """Make a finished run's `trajectory.json` ATIF, the messages moving to `messages.json`;
    None when there is no run."""
    import os

    from tmax.agents.recorder import load_run
    from tmax.common.files import write_json_atomic
    from tmax.common.records import SessionDir

    run_dir = Path(run_dir)
    files = SessionDir(run_dir)
    if not files.trajectory.is_file() and not files.messages.is_file():
        return None
    saved = load_run(run_dir)
    extra = {"status": str(saved.outcome.status)} if saved.outcome else None
    doc = to_atif(saved.messages, saved.timing, asdict(saved.usage), agent_name=agent_name,
                  agent_version=agent_version, model_name=model_name, session_id=session_id, tools=tools, extra=extra)
    if not files.messages.is_file():
        os.replace(files.trajectory, files.messages)
    write_json_atomic(files.trajectory, doc)
    return files.trajectory
