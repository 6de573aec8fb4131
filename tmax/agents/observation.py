"""Turning a command result into the text the model sees (Vanillux2 format).

    <stdout>\\n<stderr>      compose noise removed, trailing whitespace stripped
    (no output)              when that is empty
    <hint + head/tail>       when longer than max_chars
    <note>                   a sandbox note, e.g. the shell was restarted
                             (blank line)
    (exit_code=N)

Lengths are Python characters. Head and tail are not cut at line boundaries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tmax.agents.prompts import TOO_LONG_HINT
from tmax.sandbox.base import CommandResult

# podman-compose / docker-compose chatter that is about the harness, not the command.
_COMPOSE_NOISE = (
    re.compile(r"^[^\n]*Executing external compose provider[^\n]*(?:\n|$)", re.M),
    re.compile(r"^Error: executing [^\n]*docker-compose[^\n]*: exit status \d+[ \t]*(?:\n|$)", re.M),
)


@dataclass(frozen=True)
class ObservationLimits:
    max_chars: int = 10000
    head_chars: int = 5000
    tail_chars: int = 5000


def strip_compose_noise(text: str) -> str:
    for pattern in _COMPOSE_NOISE:
        text = pattern.sub("", text)
    return text


def truncate(output: str, limits: ObservationLimits = ObservationLimits(), dropped_chars: int = 0) -> str:
    """Head/tail truncation with the too-long hint.

    `dropped_chars` are characters the sandbox already dropped from the middle while
    reading (bounded memory); they count towards the length and the elided number, so the
    result is the same as if the whole output had been kept."""
    total = len(output) + dropped_chars
    if total <= limits.max_chars:
        return output
    head = output[: limits.head_chars]
    tail = output[-limits.tail_chars :] if limits.tail_chars > 0 else ""
    elided = total - len(head) - len(tail)
    return (
        f"{TOO_LONG_HINT}\n\n"
        f"---- HEAD ({limits.head_chars} chars) ----\n{head}\n"
        f"---- {elided} chars elided ----\n"
        f"---- TAIL ({limits.tail_chars} chars) ----\n{tail}"
    )


def format_observation(result: CommandResult, limits: ObservationLimits = ObservationLimits()) -> str:
    output = result.output or ""
    if result.stderr:
        output = f"{output}\n{result.stderr}" if output else result.stderr
    output = strip_compose_noise(output).rstrip()
    body = truncate(output, limits, result.dropped_chars) if output else "(no output)"
    if result.note:
        body = f"{body}\n\n{result.note}"
    return f"{body}\n\n(exit_code={result.exit_code})"
