"""Per-episode records, rewritten after every step so a crash or a kill loses at most
the step in flight.

    trajectory.json  the message list exactly as sent to the model (Harbor-compatible, indent=2)
    timing.json      one dict per step: {step, llm_s, bash_s, return_code, cmd}
                     or {step, llm_s, format_error: true, reason}; llm_s to the millisecond, bash_s to 0.1 ms
    usage.json       the session's totals: {prompt_tokens, completion_tokens, total_tokens,
                     reasoning_tokens, cost_usd, max_steps, steps, context_tokens,
                     context_window, compactions}
    tokens.json      the TokenTrace, when the policy keeps one (token-level training)
    result.json      {status, steps, error} once the episode (or a follow-up) ends
    compaction.json  `agents.compaction.SessionContext`, once the session has a follow-up or a
                     compaction: the task as first sent, the follow-ups, every compaction
    segments/segment-N.json  {segment, messages, trace}: the context and token trace a
                     compaction closed, as they were (trajectory.json and tokens.json hold
                     the context since the last compaction)
    outputs/step-N.txt  the whole output of a command that the model (or the screen) saw
                     only part of (`save_output`)

A `tmax bench` trial's agent/ ends with trajectory.json in ATIF (what Harbor reads there,
`agents.atif.write_atif`) and the messages moved to messages.json; `load_run` reads either.

Every file is written to a temporary name in the same directory and renamed over the
old one, so readers never see a half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tmax.agents.compaction import ContextUse, SessionContext
from tmax.agents.policy import TokenTrace, Usage
from tmax.common.files import write_json_atomic, write_text_atomic

TRAJECTORY = "trajectory.json"
MESSAGES = "messages.json"  # the chat messages once trajectory.json became ATIF
TIMING = "timing.json"
USAGE = "usage.json"
TOKENS = "tokens.json"
RESULT = "result.json"
COMPACTION = "compaction.json"
SEGMENTS = "segments"
OUTPUTS = "outputs"


def save_output(run_dir: Path, step: int, text: str) -> Path:
    """Keep a command's whole output as `outputs/step-N.txt` in the run directory."""
    path = run_dir / OUTPUTS / f"step-{step}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path


def usage_record(usage: Usage, max_steps: int, steps: int | None = None, context: ContextUse | None = None) -> dict[str, Any]:
    record = {**asdict(usage), "max_steps": max_steps, "steps": steps}
    if context is not None:
        record.update(context_tokens=context.used, context_window=context.window, compactions=context.compactions)
    return record


class Recorder:
    def __init__(self, dir: str | os.PathLike[str]) -> None:
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        messages: list[dict[str, Any]],
        timing: list[dict[str, Any]],
        usage: Usage,
        max_steps: int,
        trace: TokenTrace | None = None,
        *,
        steps: int | None = None,
        context: ContextUse | None = None,
        session: SessionContext | None = None,
    ) -> None:
        write_json_atomic(self.dir / TRAJECTORY, messages)
        write_json_atomic(self.dir / TIMING, timing)
        write_json_atomic(self.dir / USAGE, usage_record(usage, max_steps, steps, context))
        if trace is not None:
            # Token lists are long; no indentation keeps the file a few times smaller.
            write_json_atomic(self.dir / TOKENS, asdict(trace), indent=None)
        if session is not None:
            write_json_atomic(self.dir / COMPACTION, session.model_dump(mode="json"))

    def close_segment(self, segment: int, messages: list[dict[str, Any]], trace: TokenTrace | None) -> None:
        """Keep the context (and token trace) a compaction is about to replace."""
        record = {"segment": segment, "messages": messages, "trace": asdict(trace) if trace is not None else None}
        write_json_atomic(self.dir / SEGMENTS / f"segment-{segment}.json", record, indent=None)

    def finish(self, status: str, steps: int, error: str | None) -> None:
        write_json_atomic(self.dir / RESULT, {"status": status, "steps": steps, "error": error})


@dataclass
class SavedRun:
    messages: list[dict[str, Any]]
    timing: list[dict[str, Any]]
    usage: Usage
    max_steps: int | None
    result: dict[str, Any] | None
    trace: TokenTrace | None
    steps: int | None = None  # model turns of the whole session (usage.json)
    context: SessionContext | None = None  # compaction.json


@dataclass
class Segment:
    """A context that a compaction closed (`segments/segment-N.json`)."""

    segment: int
    messages: list[dict[str, Any]]
    trace: TokenTrace | None


def load_segments(dir: str | os.PathLike[str]) -> list[Segment]:
    """The closed segments of a run directory, in order ([] when it never compacted)."""
    files = sorted(Path(dir, SEGMENTS).glob("segment-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    out = []
    for path in files:
        record = _read(path)
        trace = TokenTrace(**record["trace"]) if record.get("trace") is not None else None
        out.append(Segment(int(record["segment"]), list(record["messages"]), trace))
    return out


def _read(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_run(dir: str | os.PathLike[str]) -> SavedRun:
    """Read a run directory back (for `tmax show` and `tmax run --resume`)."""
    d = Path(dir)
    if d.is_file() and d.name in (TRAJECTORY, MESSAGES):
        d = d.parent
    source = d / MESSAGES if (d / MESSAGES).is_file() else d / TRAJECTORY
    if not source.is_file():
        raise FileNotFoundError(f"no {TRAJECTORY} in {d}: not a tmax run directory")
    messages = _read(source)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{source} is not a list of chat messages")
    timing = _read(d / TIMING) if (d / TIMING).is_file() else []
    usage_raw = _read(d / USAGE) if (d / USAGE).is_file() else {}
    usage = Usage.from_record(usage_raw)
    trace = None
    if (d / TOKENS).is_file():
        trace = TokenTrace(**_read(d / TOKENS))
    result = _read(d / RESULT) if (d / RESULT).is_file() else None
    context = SessionContext.model_validate(_read(d / COMPACTION)) if (d / COMPACTION).is_file() else None
    steps = usage_raw.get("steps")
    return SavedRun(messages, timing, usage, usage_raw.get("max_steps"), result, trace,
                    int(steps) if steps is not None else None, context)
