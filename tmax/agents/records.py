"""Per-episode records, rewritten after every step so a crash or a kill loses at most
the step in flight.

    trajectory.json  the message list exactly as sent to the model (Harbor-compatible, indent=2)
    timing.json      one dict per step: {step, llm_s, bash_s, return_code, cmd}
                     or {step, llm_s, format_error: true, reason}; seconds to the millisecond
    usage.json       {prompt_tokens, completion_tokens, total_tokens, reasoning_tokens, cost_usd, max_steps}
    tokens.json      the TokenTrace, when the policy keeps one (token-level training)
    result.json      {status, steps, error} once the episode (or a follow-up) ends

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

from tmax.agents.policy import TokenTrace, Usage
from tmax.common.files import write_json_atomic, write_text_atomic

TRAJECTORY = "trajectory.json"
MESSAGES = "messages.json"  # the chat messages once trajectory.json became ATIF
TIMING = "timing.json"
USAGE = "usage.json"
TOKENS = "tokens.json"
RESULT = "result.json"


def usage_record(usage: Usage, max_steps: int, cost_usd: float = 0.0) -> dict[str, Any]:
    return {**asdict(usage), "cost_usd": cost_usd, "max_steps": max_steps}


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
        cost_usd: float = 0.0,
    ) -> None:
        write_json_atomic(self.dir / TRAJECTORY, messages)
        write_json_atomic(self.dir / TIMING, timing)
        write_json_atomic(self.dir / USAGE, usage_record(usage, max_steps, cost_usd))
        if trace is not None:
            # Token lists are long; no indentation keeps the file a few times smaller.
            write_json_atomic(self.dir / TOKENS, asdict(trace), indent=None)

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
    usage = Usage(**{k: int(usage_raw.get(k, 0)) for k in ("prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens")})
    trace = None
    if (d / TOKENS).is_file():
        trace = TokenTrace(**_read(d / TOKENS))
    result = _read(d / RESULT) if (d / RESULT).is_file() else None
    return SavedRun(messages, timing, usage, usage_raw.get("max_steps"), result, trace)
