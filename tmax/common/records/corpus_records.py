"""The records of a resumable job's items and of a generated corpus."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, computed_field

from tmax.common.records.record_io import Record


class JobItemResult(Record):
    """`<dir>/<item>.json` of a resumable job (`tasks.job_runner.ResultFiles`): an item's
    result (whatever its function returned, as JSON), kept for the identity it ran with."""

    identity: str = ""
    result: Any = None


# --- a generated corpus's records -----------------------------------------------------------


class SolveAttempt(Record):
    """One attempt of a solver at a task (`tmax data solve`)."""

    trial: str
    outcome: str  # `tasks.scoring` outcome: pass, fail, agent_timeout, infra_error, ...
    reward: float | None = None


class SolveSummary(Record):
    """`<corpus>/.tmax-solve/<solver tag>/<task>.json`: how often a solver solved a task
    (`tmax data solve`, or a native corpus's solution summary taken over on import, which
    keeps runs, successes and pass@k only)."""

    task: Annotated[str, Field(description="The task's name.")] = ""
    agent: Annotated[str | None, Field(description="The solver's agent.")] = None
    model: Annotated[str | None, Field(description="The solver's model.")] = None
    num_attempts: Annotated[int | None, Field(description="Attempts made (k); None: as many as were scored.")] = None
    num_runs: Annotated[int, Field(description="Attempts that reached a verdict (n).")] = 0
    num_success: Annotated[int, Field(description="Attempts that passed (c).")] = 0
    num_infra_errors: Annotated[int, Field(description="Attempts lost to infrastructure errors (not counted in n).")] = 0
    pass_at_k: Annotated[dict[str, float], Field(description="The unbiased pass@k for every k up to n.")] = {}
    results: Annotated[list[SolveAttempt], Field(description="Each attempt.")] = []

    @computed_field  # written with the summary, for a reader of the file
    @property
    def success_rate(self) -> float | None:
        """c/n; None without a scored attempt."""
        return self.num_success / self.num_runs if self.num_runs else None

    @property
    def attempts(self) -> int:
        return self.num_attempts if self.num_attempts is not None else self.num_runs


class InitialCheck(Record):
    """What the `initial` gate's agent (`tasks.corpus.validate.InitialCheckAgent`) keeps in
    its trial's `agent_result.metadata` (Harbor's free-form dict)."""

    initial: Annotated[Literal["absent", "passed", "failed"],
                       Field(description="The initial-state test's result; absent: the task has none.")]
    output: Annotated[str, Field(description="The tail of what the test printed.")] = ""


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
