"""The records tmax writes into the task directories it generates."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError

from tmax.common.records.record_io import Record, RecordError

# The fields only the long-horizon family writes (`training.nano.long_tasks`).
LONG_ONLY = frozenset({"thoughts", "revealed", "value", "decoy", "value_step"})


class NanoMeta(Record):
    """A generated nano task's `[metadata.nano]` table in its task.toml (`training.nano`):
    the task's kind and split, its oracle, and (long-horizon tasks) what the sloppy teacher
    needs. A one-command task written before `family` and `depth` were recorded reads as
    family "nano", depth 1."""

    kind: Annotated[str, Field(description="The task kind (count_lines, lookup, ...).")]
    split: Annotated[str, Field(description="train, heldout or template.")]
    commands: Annotated[list[str], Field(description="The oracle: the shell commands that solve it, submit not included.")]
    params: Annotated[dict[str, str | int], Field(description="What varies between tasks of one kind.")] = {}
    family: Annotated[str, Field(description="nano (one command) or long (several dependent commands).")] = "nano"
    depth: Annotated[int, Field(description="The number of commands the task needs.")] = 1
    thoughts: Annotated[list[str], Field(description="The THOUGHT text of each oracle command (long tasks).")] = []
    revealed: Annotated[list[str], Field(description="The values only an observation reveals (long tasks).")] = []
    value: Annotated[str, Field(description="The value a sloppy teacher swaps for the decoy (long tasks).")] = ""
    decoy: Annotated[str, Field(description="The wrong value the task also holds (long tasks).")] = ""
    value_step: Annotated[int, Field(description="The oracle command that uses `value` (long tasks).")] = 0

    def toml_table(self) -> dict[str, object]:
        """The table as written: a one-command task leaves the long family's fields out."""
        return self.model_dump(exclude=set(LONG_ONLY) if self.family == "nano" else None)

    @classmethod
    def read(cls, task_dir: Path) -> NanoMeta:
        """The table of `task_dir/task.toml`; a task without one (not a generated nano task)
        or with a broken one is a `RecordError`."""
        path = Path(task_dir) / "task.toml"
        try:
            table = tomllib.loads(path.read_text()).get("metadata", {}).get("nano")  # a user's TOML: open
        except tomllib.TOMLDecodeError as e:
            raise RecordError(f"{path}: {e}") from None
        if not table:
            raise RecordError(f"{path}: no [metadata.nano] table (not a generated nano task)")
        try:
            return cls.model_validate(table)
        except ValidationError as e:
            raise RecordError(f"{path}: [metadata.nano] is not a NanoMeta record: {e}") from None
