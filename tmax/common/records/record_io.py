"""Reading and writing a record, and the statuses records share."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from tmax.common.files import write_json_atomic


R = TypeVar("R", bound=BaseModel)


class RecordError(ValueError):
    """A record file that exists but is not the record it should be."""


def read_record(path: Path, model: type[R]) -> R:
    """The record in `path`; a file that is not JSON or not that record is a `RecordError`
    naming the file."""
    try:
        return model.model_validate_json(Path(path).read_bytes())
    except (ValidationError, ValueError) as e:
        raise RecordError(f"{path} is not a {model.__name__} record: {e}") from None


def read_optional(path: Path, model: type[R]) -> R | None:
    """The record in `path`, or None when there is no such file."""
    return read_record(path, model) if Path(path).is_file() else None


def write_record(path: Path, record: BaseModel, indent: int | None = 2) -> None:
    """Write a record atomically (`common.files.write_json_atomic`)."""
    write_json_atomic(path, record.model_dump(mode="json"), indent=indent)


def now_stamp() -> str:
    """The local time as records keep it (2026-01-31T12:00:00+0100)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Record(BaseModel):
    # Keys an older or newer tmax wrote that this one does not know are skipped, not refused.
    model_config = ConfigDict(extra="ignore")

    @classmethod
    def of(cls: type[R], data: object) -> R | None:
        """`data` (JSON already read, a free-form dict) as this record; None where it is empty
        or something else (another agent's metadata, an error a worker answered)."""
        try:
            return cls.model_validate(data) if data else None
        except ValidationError:
            return None


# --- statuses -----------------------------------------------------------------------------


class AgentStatus(StrEnum):
    """How an agent loop (and the `tmax run` session around it) ended; `RUNNING` only in a
    run.json whose session is still going (or was killed)."""

    SUBMITTED = "submitted"
    MAX_STEPS = "max_steps"
    CONTEXT_OVERFLOW = "context_overflow"
    FORMAT_ERRORS = "format_errors"
    MODEL_ERROR = "model_error"
    INTERRUPTED = "interrupted"
    SANDBOX_ERROR = "sandbox_error"
    STOPPED = "stopped"  # a stop request (a training run's deadline, a shut-down pool)
    ABANDONED = "abandoned"  # the driver gave the episode up (`agents.driver`)
    INTERNAL_ERROR = "internal_error"
    RUNNING = "running"
    UNKNOWN = "unknown"  # a session directory without its outcome


class RatingSource(StrEnum):
    USER = "user"  # /good or /bad
    VERIFY = "verify"  # --verify CMD


class HealthMark(StrEnum):
    HEALTHY = "healthy"
    COLLAPSED = "collapsed"
