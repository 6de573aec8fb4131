"""The one Dockerfile reader of tmax, on `dockerfile-parse`: instructions with their line
continuations joined and comments left out, and the parts of a FROM line.

Every module that reads a task's Dockerfile (the offline rewrite, the host sandboxes'
check, the generator's parser) goes through `instructions`, so a continuation or a comment
inside one is read the same way everywhere.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from dockerfile_parse import DockerfileParser


@dataclass(frozen=True)
class Instruction:
    op: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the arguments, continuations joined, variables not substituted
    start: int  # first line, 0-based
    end: int  # last line, 0-based (> start for a continued instruction)
    text: str  # as written

    @property
    def line(self) -> int:
        """1-based first line, for messages."""
        return self.start + 1


def instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile in order, comments and parser directives left out."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode("utf-8")), env_replace=False)
    out = [Instruction(i["instruction"].upper(), i["value"].strip(), i["startline"], i["endline"],
                       i["content"].rstrip("\n"))
           for i in parser.structure if i["instruction"] != "COMMENT"]
    return sorted(out, key=lambda i: i.start)


@dataclass(frozen=True)
class FromLine:
    flags: list[str]  # --platform=... and the like
    image: str
    stage: str | None  # the `AS name`, if any
    as_word: str = "AS"  # as written ("as" is valid too)


def from_parts(value: str) -> FromLine:
    """`[--flag ...] IMAGE [AS NAME]` of a FROM instruction's value."""
    words = value.split()
    flags = [w for w in words if w.startswith("--")]
    rest = [w for w in words if not w.startswith("--")]
    if not rest:
        raise ValueError("FROM names no image")
    if len(rest) >= 3 and rest[1].upper() == "AS":
        return FromLine(flags, rest[0], rest[2], rest[1])
    return FromLine(flags, rest[0], None)
