"""The records of a session directory (`tmax run`, one episode of `tmax bench` or `tmax learn`)."""

from __future__ import annotations

from pydantic import Field, RootModel

from tmax.common.records.record_io import AgentStatus, RatingSource, Record, now_stamp


class EpisodeOutcome(Record):
    """outcome.json: how the agent loop ended, written once the episode (or a follow-up) ends."""

    status: AgentStatus
    steps: int
    error: str | None = None


class AgentMeta(Record):
    """What the tmax agent keeps in a trial's `agent_result.metadata` (Harbor's free-form
    dict; another agent keeps something else there)."""

    status: AgentStatus
    steps: int
    error: str | None = None
    llm_s: float = 0.0
    exec_s: float = 0.0
    turn_outcomes: list[str] = []


class StepTiming(Record):
    """One entry of timing.json: a command step (`bash_s`, `return_code`), a rejected one, a
    format error (`format_error`, `reason`), a step whose sandbox failed (`sandbox_error`),
    or a compaction (`compaction`: its segment, no step)."""

    step: int | None = None
    compaction: int | None = None
    ok: bool | None = None  # a compaction's: whether it was done
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


class SegmentRecord(Record):
    """segments/segment-N.json: a context a compaction closed, and its token trace (the
    fields of `agents.policy.TokenTrace`) where the policy kept one."""

    segment: int
    messages: list[dict[str, object]]
    trace: dict[str, object] | None = None


class UsageRecord(Record):
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


class InstructionSource(Record):
    path: str
    chars: int
    kept: int


class RunRecord(Record):
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


class Rating(Record):
    """reward.json: the session's reward and who gave it; a --verify rating keeps the
    command, its exit status and the tail of its output."""

    reward: float = Field(strict=True, allow_inf_nan=False)
    source: RatingSource = RatingSource.USER  # a reward.json written by hand
    at: str = Field(default_factory=now_stamp)
    command: str | None = None
    exit_code: int | None = None
    output: str | None = None
