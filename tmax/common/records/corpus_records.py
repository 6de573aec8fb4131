"""The records of a resumable job's items and of a generated corpus."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from tmax.common.records.record_io import Record


class JobItemResult(Record):
    """`<dir>/<item>.json` of a resumable job (`tasks.job_runner.ResultFiles`): an item's
    result (whatever its function returned, as JSON), kept for the identity it ran with."""

    identity: str = ""
    result: Any = None


# --- a generated corpus's records -----------------------------------------------------------


class GenerationStatus(StrEnum):
    PENDING = "pending"
    KEPT = "kept"
    REJECTED = "rejected"


class CorpusIdentity(Record):
    """What a resumed generation must share with the first run (the rest may change)."""

    seed: int
    n: int
    corpus_kind: str
    axes: str  # `tasks.corpus.axes.AxesConfig.fingerprint`


class GenerationIdentity(Record):
    """`.generate/config.json`: what a generated corpus was made with."""

    identity: CorpusIdentity
    config: dict[str, object] = {}  # the generation config as given, for the record


class GeneratedEnvironment(Record):
    """A generated task's environment, as the model wrote it."""

    dockerfile: str = ""
    files: dict[str, str] = {}
    solve: str | None = None


class GateRound(Record):
    """One round of a generated task through the gates: the gates it failed, and why."""

    failed: list[str] = []
    reasons: dict[str, str] = {}


class Rejection(Record):
    """`_rejected/<task>/rejection.json`: why a generated task was rejected."""

    task: str
    slot: int
    attempt: int
    failed_gate: str | None = None
    reason: str = ""
    rounds: list[GateRound] = []
    axes: dict[str, object] = {}
