"""The JSON records tmax writes and reads back itself, and the layout of the directories
that hold them, each named once here.

A session directory (`tmax run`, one episode of `tmax bench` or `tmax learn`), `SessionDir`:

    trajectory.json  the messages as sent to the model (ATIF in a bench trial's agent/)
    messages.json    the messages, once trajectory.json became ATIF
    timing.json      one `StepTiming` per step
    usage.json       `UsageRecord`: the session's token totals
    tokens.json      the token trace (`agents.policy.TokenTrace`), with --tokens
    outcome.json     `EpisodeOutcome`: how the agent loop ended (result.json before; still read)
    compaction.json  `agents.compaction.SessionContext`
    segments/segment-N.json, outputs/step-N.txt
    run.json         `RunRecord`: the `tmax run` command's own record of the session
    reward.json      `Rating`: the session's reward (/good, /bad, --verify)

A `tmax learn` run directory, `LearnRunDir`: metrics.jsonl, rollouts.jsonl, summary.json,
recipe.json, sft/sft.json (`SftRecord`), checkpoints/step_N/ with trainer_state.json
(`CheckpointMeta`) and health.json (`HealthRecord`). An engine's work directory keeps
weights.version.json (`WeightsManifest`). A generated corpus keeps `.generate/config.json`
(`GenerationIdentity`) and `_rejected/<task>/rejection.json` (`Rejection`).

A trial's result.json is Harbor's format (`common.harbor.TrialResult`), not one of these.
Every reader here takes the files older versions of tmax wrote (new fields have defaults).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

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


class _Record(BaseModel):
    # Keys an older or newer tmax wrote that this one does not know are skipped, not refused.
    model_config = ConfigDict(extra="ignore")


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


# --- directory layouts --------------------------------------------------------------------


@dataclass(frozen=True)
class SessionDir:
    """The files of one session directory."""

    dir: Path

    @property
    def trajectory(self) -> Path:
        return self.dir / "trajectory.json"

    @property
    def messages(self) -> Path:
        return self.dir / "messages.json"

    @property
    def timing(self) -> Path:
        return self.dir / "timing.json"

    @property
    def usage(self) -> Path:
        return self.dir / "usage.json"

    @property
    def tokens(self) -> Path:
        return self.dir / "tokens.json"

    @property
    def outcome(self) -> Path:
        return self.dir / "outcome.json"

    @property
    def compaction(self) -> Path:
        return self.dir / "compaction.json"

    @property
    def segments(self) -> Path:
        return self.dir / "segments"

    def segment(self, n: int) -> Path:
        return self.segments / f"segment-{n}.json"

    @property
    def outputs(self) -> Path:
        return self.dir / "outputs"

    def output(self, step: int) -> Path:
        return self.outputs / f"step-{step}.txt"

    @property
    def run(self) -> Path:
        return self.dir / "run.json"

    @property
    def reward(self) -> Path:
        return self.dir / "reward.json"

    @property
    def instructions(self) -> Path:
        return self.dir / "instructions.md"

    def read_outcome(self) -> EpisodeOutcome | None:
        """outcome.json; a directory an older tmax wrote keeps it as result.json."""
        if self.outcome.is_file():
            return read_record(self.outcome, EpisodeOutcome)
        legacy = self.dir / "result.json"
        if not legacy.is_file():
            return None
        try:
            return read_record(legacy, EpisodeOutcome)
        except RecordError:
            return None  # a trial's result.json (Harbor's), not an outcome

    def read_usage(self) -> UsageRecord:
        return read_optional(self.usage, UsageRecord) or UsageRecord()

    def read_timing(self) -> list[StepTiming]:
        records = read_optional(self.timing, TimingRecords)
        return records.root if records is not None else []

    def read_run(self) -> RunRecord | None:
        return read_optional(self.run, RunRecord)


@dataclass(frozen=True)
class LearnRunDir:
    """The files of one `tmax learn` run directory (a recipe's RL run is its `rl/`)."""

    dir: Path

    @property
    def metrics(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def rollouts(self) -> Path:
        return self.dir / "rollouts.jsonl"

    @property
    def summary(self) -> Path:
        return self.dir / "summary.json"

    @property
    def recipe(self) -> Path:
        return self.dir / "recipe.json"

    @property
    def reward_curve(self) -> Path:
        return self.dir / "reward_curve.png"

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    @property
    def rl(self) -> LearnRunDir:
        return LearnRunDir(self.dir / "rl")

    @property
    def sft(self) -> Path:
        return self.dir / "sft"


CHECKPOINT_META = "trainer_state.json"
HEALTH = "health.json"
SFT_RECORD = "sft.json"
WEIGHTS_MANIFEST = "weights.version.json"


# --- a session's records ------------------------------------------------------------------


class EpisodeOutcome(_Record):
    """outcome.json: how the agent loop ended, written once the episode (or a follow-up) ends."""

    status: AgentStatus
    steps: int
    error: str | None = None


class AgentMeta(_Record):
    """What the tmax agent keeps in a trial's `agent_result.metadata` (Harbor's free-form
    dict; another agent keeps something else there)."""

    status: AgentStatus
    steps: int
    error: str | None = None
    llm_s: float = 0.0
    exec_s: float = 0.0
    turn_outcomes: list[str] = []

    @classmethod
    def of(cls, metadata: dict[str, object] | None) -> AgentMeta | None:
        """The tmax agent's record in `metadata`; None where another agent wrote it."""
        try:
            return cls.model_validate(metadata) if metadata else None
        except ValidationError:
            return None


class StepTiming(_Record):
    """One entry of timing.json: a command step (`bash_s`, `return_code`), a rejected one, a
    format error (`format_error`, `reason`), a step whose sandbox failed (`sandbox_error`),
    or a compaction (`compaction`: its segment, no step)."""

    step: int | None = None
    compaction: int | None = None
    rejected: bool = False
    llm_s: float | None = None
    bash_s: float | None = None
    return_code: int | None = None
    cmd: str | None = None
    format_error: bool = False
    reason: str | None = None
    sandbox_error: str | None = None


class TimingRecords(RootModel[list[StepTiming]]):
    """timing.json: a list of `StepTiming`, one per step."""


class SegmentRecord(_Record):
    """segments/segment-N.json: a context a compaction closed, and its token trace (the
    fields of `agents.policy.TokenTrace`) where the policy kept one."""

    segment: int
    messages: list[dict[str, object]]
    trace: dict[str, object] | None = None


class UsageRecord(_Record):
    """usage.json: the session's token totals, its step limit and how full its context got."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0
    max_steps: int | None = None
    steps: int | None = None  # model turns of the whole session
    context_tokens: int | None = None
    context_window: int | None = None
    compactions: int | None = None


class InstructionSource(_Record):
    path: str
    chars: int
    kept: int


class RunRecord(_Record):
    """run.json: the `tmax run` command's own record of a session; "running" until the
    session ends, which every exit records."""

    task: str | None = None
    model: str | None = None
    harness: str | None = None
    base_url: str | None = None
    sandbox: str | None = None
    mode: str | None = None
    workdir: str | None = None
    resumed_from: str | None = None
    started_at: str | None = None
    status: AgentStatus = AgentStatus.RUNNING
    instructions: list[InstructionSource] = []
    model_dir: str | None = None  # the served model's directory, with --tokens
    error: str | None = None
    steps: int | None = None
    finished_at: str | None = None


class Rating(_Record):
    """reward.json: the session's reward and who gave it; a --verify rating keeps the
    command, its exit status and the tail of its output."""

    reward: float = Field(strict=True, allow_inf_nan=False)
    source: RatingSource = RatingSource.USER  # a reward.json written by hand
    at: str = Field(default_factory=now_stamp)
    command: str | None = None
    exit_code: int | None = None
    output: str | None = None


# --- a training run's records -------------------------------------------------------------


class GuardState(_Record):
    """The collapse guard's remedies, kept in each checkpoint so a resumed run keeps them."""

    rollbacks: int = 0
    lr_scale: float = 1.0
    group_size: int | None = None  # None: the config's


class CheckpointExtra(_Record):
    """Where a resumed run continues (the prompt stream's and the rated sessions' positions,
    the guard's remedies); an SFT result says what trained it."""

    prompt_position: int = 0
    rated_position: int | None = None
    config: str | None = None  # the run config's name
    guard: GuardState = GuardState()
    sft_steps: int | None = None
    sft_demos: int | None = None


class GuardSummary(_Record):
    """The collapse guard's rollbacks and stop over a run (summary.json's `guard`), from the
    events it logged in metrics.jsonl (`guard/event`, kept as logged)."""

    rollbacks: int = 0
    steps_lost: int = 0
    stopped: bool = False
    stop_reason: str | None = None
    events: list[dict[str, Any]] = []


class CheckpointMeta(_Record):
    """trainer_state.json beside a checkpoint's weights (the tensors are trainer_state.pt)."""

    step: int
    time: float = 0.0
    extra: CheckpointExtra = CheckpointExtra()


class HealthRecord(BaseModel):
    """health.json: the guard's judgement of a checkpoint, with what it saw (extra keys)."""

    model_config = ConfigDict(extra="allow")

    mark: HealthMark
    time: float = 0.0


class SftRecord(_Record):
    """sft/sft.json: what a finished SFT stage trained (a rerun skips the stage)."""

    steps: int
    demos: int
    losses: list[float] = []


class WeightsManifest(_Record):
    """weights.version.json in an engine's work directory: the policy version of the weights
    (or adapter) last pushed through a file, for an engine restarted after its server died."""

    version: int


class WorkerReply(_Record):
    """What a vLLM worker of ours (`training.weights.vllm_ext`) answers to a load or a join."""

    n_tensors: int | None = None
    rank: int | None = None

    @classmethod
    def of(cls, reply: object) -> WorkerReply | None:
        """A worker's reply; None for one that is not a reply of ours (an error, a string)."""
        try:
            return cls.model_validate(reply)
        except ValidationError:
            return None


# --- a resumable job's records -------------------------------------------------------------


class JobItemResult(_Record):
    """`<dir>/<item>.json` of a resumable job (`tasks.job_runner.ResultFiles`): an item's
    result (whatever its function returned, as JSON), kept for the identity it ran with."""

    identity: str = ""
    result: Any = None


# --- a generated corpus's records -----------------------------------------------------------


class GenerationStatus(StrEnum):
    PENDING = "pending"
    KEPT = "kept"
    REJECTED = "rejected"


class CorpusIdentity(_Record):
    """What a resumed generation must share with the first run (the rest may change)."""

    seed: int
    n: int
    corpus_kind: str
    axes: str  # `tasks.corpus.axes.AxesConfig.fingerprint`


class GenerationIdentity(_Record):
    """`.generate/config.json`: what a generated corpus was made with."""

    identity: CorpusIdentity
    config: dict[str, object] = {}  # the generation config as given, for the record


class GeneratedEnvironment(_Record):
    """A generated task's environment, as the model wrote it."""

    dockerfile: str = ""
    files: dict[str, str] = {}
    solve: str | None = None


class GateRound(_Record):
    """One round of a generated task through the gates: the gates it failed, and why."""

    failed: list[str] = []
    reasons: dict[str, str] = {}


class Rejection(_Record):
    """`_rejected/<task>/rejection.json`: why a generated task was rejected."""

    task: str
    slot: int
    attempt: int
    failed_gate: str | None = None
    reason: str = ""
    rounds: list[GateRound] = []
    axes: dict[str, object] = {}
