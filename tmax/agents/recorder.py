"""Per-episode records, rewritten after every step so a crash or a kill loses at most
the step in flight. The files, and the records they hold, are named in `common.records`
(`SessionDir`): the messages exactly as sent (trajectory.json), per-step timing, the token
usage, the token trace (token-level training), the outcome once the episode (or a
follow-up) ends, the compaction record, the closed segments and the whole outputs of
commands the model saw only part of.

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
from tmax.common.records import (AgentStatus, EpisodeOutcome, SegmentRecord, SessionDir, StepTiming, UsageRecord,
                                 read_record, write_record)


def save_output(run_dir: Path, step: int, text: str) -> Path:
    """Keep a command's whole output as `outputs/step-N.txt` in the run directory."""
    path = SessionDir(run_dir).output(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path


def usage_record(usage: Usage, max_steps: int, steps: int | None = None, context: ContextUse | None = None) -> UsageRecord:
    record = UsageRecord(**asdict(usage), max_steps=max_steps, steps=steps)
    if context is not None:
        record = record.model_copy(update={"context_tokens": context.used, "context_window": context.window,
                                           "compactions": context.compactions})
    return record


class Recorder:
    def __init__(self, dir: str | os.PathLike[str]) -> None:
        self.dir = Path(dir)
        self.files = SessionDir(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        messages: list[dict[str, Any]],
        timing: list[StepTiming],
        usage: Usage,
        max_steps: int,
        trace: TokenTrace | None = None,
        *,
        steps: int | None = None,
        context: ContextUse | None = None,
        session: SessionContext | None = None,
    ) -> None:
        files = self.files
        write_json_atomic(files.trajectory, messages)
        write_json_atomic(files.timing, [t.model_dump(exclude_defaults=True) for t in timing])
        write_record(files.usage, usage_record(usage, max_steps, steps, context))
        if trace is not None:
            # Token lists are long; no indentation keeps the file a few times smaller.
            write_json_atomic(files.tokens, asdict(trace), indent=None)
        if session is not None:
            write_record(files.compaction, session)

    def close_segment(self, segment: int, messages: list[dict[str, Any]], trace: TokenTrace | None) -> None:
        """Keep the context (and token trace) a compaction is about to replace."""
        record = SegmentRecord(segment=segment, messages=messages, trace=asdict(trace) if trace is not None else None)
        write_record(self.files.segment(segment), record, indent=None)

    def finish(self, status: AgentStatus, steps: int, error: str | None) -> None:
        write_record(self.files.outcome, EpisodeOutcome(status=status, steps=steps, error=error))


@dataclass
class SavedRun:
    messages: list[dict[str, Any]]
    timing: list[StepTiming]
    usage: Usage
    max_steps: int | None
    outcome: EpisodeOutcome | None
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
    files = sorted(SessionDir(Path(dir)).segments.glob("segment-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    out = []
    for path in files:
        record = read_record(path, SegmentRecord)
        trace = TokenTrace(**record.trace) if record.trace is not None else None
        out.append(Segment(record.segment, record.messages, trace))
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
    if d.is_file() and d.name in ("trajectory.json", "messages.json"):
        d = d.parent
    files = SessionDir(d)
    source = files.messages if files.messages.is_file() else files.trajectory
    if not source.is_file():
        raise FileNotFoundError(f"no {files.trajectory.name} in {d}: not a tmax run directory")
    messages = _read(source)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{source} is not a list of chat messages")
    timing = files.read_timing()
    usage = files.read_usage()
    trace = TokenTrace(**_read(files.tokens)) if files.tokens.is_file() else None
    context = read_record(files.compaction, SessionContext) if files.compaction.is_file() else None
    return SavedRun(messages, timing, Usage.from_record(usage), usage.max_steps, files.read_outcome(), trace,
                    usage.steps, context)
