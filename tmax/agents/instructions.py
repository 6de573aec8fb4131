"""Project instructions (`tmax run`): `AGENTS.md` files and `--instructions FILE`, added to
the system prompt.

Which files: `AGENTS.md` in the working directory and in each directory above it up to the
repository root (the nearest directory holding `.git`; without one, the working directory's
own file only), the root's first and the working directory's last, so the more specific
instruction comes later; then the file `--instructions` names. Together they are capped at
`MAX_CHARS` characters (what is over is cut, and the cut is said in the prompt and on the
screen). They go at the end of the system prompt under `HEADING`, each under its path (a
harness without a system prompt, terminus-2, gets them as one). Benchmarks and training never
read them: the Vanillux2 prompt stays exact there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_NAME = "AGENTS.md"
MAX_CHARS = 16_000
HEADING = (
    "# Project instructions\n\nThe user's project gives these instructions (from its AGENTS.md files; where "
    "they disagree, the later, more specific one wins). Follow them unless the task says otherwise."
)


class InstructionsError(ValueError):
    """An instructions file that cannot be read."""


@dataclass
class Source:
    path: str
    chars: int  # of the file
    kept: int  # of those, in the prompt (less when the cap cut it)


@dataclass
class Instructions:
    """The text added to the system prompt, and where it came from."""

    sources: list[Source] = field(default_factory=list)
    text: str = ""

    @property
    def cut(self) -> bool:
        return any(s.kept < s.chars for s in self.sources)

    def describe(self) -> str:
        """One line for the start of a run."""
        files = ", ".join(s.path + (f" (cut to {s.kept} of {s.chars} characters)" if s.kept < s.chars else "")
                          for s in self.sources)
        return f"project instructions: {files}"


def agents_files(workdir: Path) -> list[Path]:
    """`AGENTS.md` files from the repository root down to `workdir` (see the module doc)."""
    workdir = workdir.resolve()
    chain = [workdir, *workdir.parents]
    root = next((d for d in chain if (d / ".git").exists()), None)
    dirs = chain[: chain.index(root) + 1] if root is not None else [workdir]
    return [d / FILE_NAME for d in reversed(dirs) if (d / FILE_NAME).is_file()]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InstructionsError(f"cannot read the instructions file {path}: {e}") from None


def load_instructions(files: list[Path], max_chars: int = MAX_CHARS) -> Instructions:
    """The instructions of `files`, in order, within `max_chars` characters in all."""
    out = Instructions()
    blocks = []
    room = max_chars
    for path in files:
        body = _read(path).strip()
        if not body:
            continue
        kept = body[: max(0, room)]
        room -= len(kept)
        out.sources.append(Source(str(path), len(body), len(kept)))
        if kept:
            note = "" if len(kept) == len(body) else f"\n\n[... {len(body) - len(kept)} more characters cut: the limit is {max_chars}]"
            blocks.append(f"## {path}\n\n{kept}{note}")
    if blocks:
        out.text = "\n\n".join([HEADING, *blocks])
    return out


def with_instructions(messages: list[dict[str, Any]], text: str | None) -> list[dict[str, Any]]:
    """`messages` with `text` at the end of the system prompt (or as one, where there is none)."""
    if not text:
        return messages
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
