"""Harbor's job and trial records, typed, and the one rule for what a trial scored.

The files of a Harbor job directory, as Harbor 0.26 writes them (`TrialResult`,
`TrialConfig`, `JobConfig`, `JobResult` in Harbor's `harbor.models`), and as the older
Harbor 0.6.6 of the published Terminal-Bench jobs wrote them:

    <job>/config.json             JobConfig       (tmax adds `tmax_identity`, `tmax_job`)
    <job>/result.json             JobResult       (tmax adds `tmax_score`)
    <job>/<trial>/config.json     TrialConfig     (tmax adds `attempt`)
    <job>/<trial>/result.json     TrialResult     (tmax adds `tmax`: `TmaxTrial`)

Every record keeps the fields it does not name (`extra="allow"`) and is written back with
only the fields it was read or made with (`Record.dump`), so rewriting a file loses nothing
and adds nothing. Fields Harbor requires but other tools leave out are optional here: a
job another agent wrote still loads.

What a trial scored (`TrialResult.score`, the one rule every reader goes through) is what
Harbor and the paper count: the verifier's reward, whether or not the agent timed out; a
trial without a reward scores 0. Infrastructure errors (the environment, the sandbox, a
cancelled run) are not the agent's: `TrialScore.infra` marks them, and rates that leave
them out use it. The outcome labels describe how a trial ended (`outcome_of`); they never
decide its reward.

This module imports nothing of tmax (the bottom layer): the readers and writers are in
`tasks.job`, `tasks.trial` and `tasks.job_dirs`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Outcome labels: how a trial ended. `cancelled` is never scored (the trial is rerun).
PASS, FAIL, AGENT_TIMEOUT, INFRA_ERROR, VERIFIER_ERROR, CANCELLED = (
    "pass", "fail", "agent_timeout", "infra_error", "verifier_error", "cancelled")
OUTCOMES = (PASS, FAIL, AGENT_TIMEOUT, INFRA_ERROR, VERIFIER_ERROR)
# A reward at least this high is a success (pass@k); rewards are 0 or 1 on Terminal-Bench.
SUCCESS = 1.0 - 1e-9
# Harbor's exception types for a verifier that ran and gave no reward (tmax writes the same).
VERIFIER_ERRORS = frozenset({"VerifierTimeoutError", "RewardFileNotFoundError", "RewardFileEmptyError",
                             "VerifierOutputParseError", "VerifierError"})
# The agent's own failures (Harbor's error policy: the reward stays valid): a trial that
# ended in one is the agent's fail even without a reward, never an infrastructure error.
AGENT_ERRORS = frozenset({"AgentError", "NonZeroAgentExitCodeError", "ContextWindowExceededError",
                          "ContextLengthExceededError", "OutputTokenExceededError", "OutputLengthExceededError",
                          "AgentSafetyRefusalError", "ContentPolicyViolationError"})
AGENT_TIMEOUT_ERROR, CANCELLED_ERROR = "AgentTimeoutError", "CancelledError"

R = TypeVar("R", bound="Record")


class Record(BaseModel):
    """A Harbor record: unknown fields kept, written back as it was read (`dump`)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def dump(self) -> dict[str, Any]:
        """JSON-ready: the fields read or set, and the unknown ones as they were."""
        return self.model_dump(mode="json", exclude_unset=True)

    @classmethod
    def parse(cls: type[R], data: Any) -> R | None:
        """`data` (JSON already read) as this record, or None where it is missing or not one:
        a file another process has not finished, or another tool's file of another kind."""
        if not isinstance(data, dict):
            return None
        try:
            return cls.model_validate(data)
        except ValidationError:
            return None


# --- a trial's config.json ------------------------------------------------------------------
class TaskConfig(Record):
    """Which task a trial ran: a local path, a git task, or a registry package."""

    path: str | None = None
    git_url: str | None = None
    git_commit_id: str | None = None
    name: str | None = None
    ref: str | None = None
    overwrite: bool = False
    download_dir: str | None = None
    source: str | None = None
    checksum: str | None = None  # tmax's
    # Other tools' ways of naming a task's category (tmax reads task.toml's first).
    category: str | None = None
    metadata: dict[str, Any] | None = None


class AgentConfig(Record):
    """An agent by name (Harbor's own) or by import path (any other)."""

    name: str | None = None
    import_path: str | None = None
    model_name: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)


class EnvironmentConfig(Record):
    type: str | None = None
    import_path: str | None = None
    delete: bool = True


class VerifierConfig(Record):
    disable: bool = False


class TrialConfig(Record):
    schema_version: int = 1
    task: TaskConfig | None = None
    trial_name: str = ""
    trials_dir: str | None = None
    timeout_multiplier: float = 1.0
    agent: AgentConfig = Field(default_factory=AgentConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    job_id: str | None = None
    attempt: int | None = None  # tmax's: which attempt of the task this trial is


# --- a trial's result.json ------------------------------------------------------------------
class TaskId(Record):
    """LocalTaskId (path), GitTaskId (git_url, git_commit_id, path) or PackageTaskId."""

    path: str | None = None
    git_url: str | None = None
    git_commit_id: str | None = None


class ModelInfo(Record):
    name: str
    provider: str | None = None


class AgentInfo(Record):
    name: str
    version: str | None = None
    model_info: ModelInfo | None = None


class AgentContext(Record):
    """Harbor's `agent_result`: tokens, cost, and the agent's own metadata."""

    n_input_tokens: int | None = None
    n_cache_tokens: int | None = None
    n_output_tokens: int | None = None
    cost_usd: float | None = None
    metadata: dict[str, Any] | None = None


class VerifierResult(Record):
    rewards: dict[str, float | int | None] | None = None


class ExceptionInfo(Record):
    exception_type: str
    exception_message: str = ""
    exception_traceback: str = ""
    occurred_at: str | None = None


class TimingInfo(Record):
    started_at: str | None = None
    finished_at: str | None = None


class TmaxTrial(Record):
    """tmax's own fields of a trial (`tmax` in result.json); for a trial another tool wrote,
    the readers fill in what they can find (category, agent steps) and leave `outcome` None."""

    outcome: str | None = None
    environment: str | None = None
    reward: float | None = None
    attempt: int | None = None
    category: str | None = None
    image: str | None = None
    image_built: bool | None = None
    build_s: float | None = None
    build_log: str | None = None
    # podman: how the trial's sandbox was made: "overlay" (of a shared container of the task's
    # image), "overlay+files" (of one of its base image, its files written in, no image
    # built) or "container" (a container of its own)
    sandbox_mode: str | None = None
    verifier_status: str | None = None
    verifier_s: float | None = None
    agent_steps: int | None = None


@dataclass(frozen=True)
class TrialScore:
    """What a trial scored: its outcome label and the verifier's reward (None: no reward)."""

    outcome: str
    reward: float | None

    @property
    def credit(self) -> float:
        """What the trial adds to a mean reward: the reward, 0 without one."""
        return self.reward if self.reward is not None else 0.0

    @property
    def passed(self) -> bool:
        """A success for pass@k: the verifier's reward is 1, whether or not the agent timed out."""
        return self.reward is not None and self.reward >= SUCCESS

    @property
    def infra(self) -> bool:
        """Not the agent's doing: counted apart, left out of the rates that exclude infra errors."""
        return self.outcome in (INFRA_ERROR, CANCELLED)


def outcome_of(exception_type: str | None, reward: float | None) -> str:
    """How a trial ended, from its exception type and the verifier's reward."""
    if exception_type == CANCELLED_ERROR:
        return CANCELLED
    if exception_type == AGENT_TIMEOUT_ERROR:
        return AGENT_TIMEOUT
    if exception_type in VERIFIER_ERRORS:
        return VERIFIER_ERROR
    if exception_type is None or reward is not None or exception_type in AGENT_ERRORS:
        return PASS if reward is not None and reward >= SUCCESS else FAIL
    return INFRA_ERROR


class TrialResult(Record):
    schema_version: int = 1
    id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    task_name: str
    trial_name: str
    trial_uri: str | None = None
    task_id: TaskId | None = None
    source: str | None = None
    task_checksum: str | None = None
    config: TrialConfig | None = None
    agent_info: AgentInfo | None = None
    agent_result: AgentContext | None = None
    verifier_result: VerifierResult | None = None
    exception_info: ExceptionInfo | None = None
    started_at: str | None = None
    finished_at: str | None = None
    environment_setup: TimingInfo | None = None
    agent_setup: TimingInfo | None = None
    agent_execution: TimingInfo | None = None
    verifier: TimingInfo | None = None
    step_results: list[dict[str, Any]] | None = None
    tmax: TmaxTrial | None = None

    @property
    def reward(self) -> float | None:
        """The verifier's reward: `reward`, or the one reward of a verifier that named it otherwise."""
        rewards = self.verifier_result.rewards if self.verifier_result else None
        if not rewards:
            return None
        value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
        return float(value) if value is not None else None

    @property
    def exception_type(self) -> str | None:
        return self.exception_info.exception_type if self.exception_info else None

    def score(self) -> TrialScore:
        """What this trial scored (the module docstring's rule): tmax's label where tmax
        wrote the trial, else the label of its exception and reward; the reward either way."""
        reward = self.reward
        label = self.tmax.outcome if self.tmax and self.tmax.outcome else outcome_of(self.exception_type, reward)
        return TrialScore(label, reward)

    @property
    def agent_name(self) -> str | None:
        """The agent: its name in the trial's config, else (an import-path agent) the name it gave."""
        named = self.config.agent.name if self.config else None
        return named or (self.agent_info.name if self.agent_info else None)

    @property
    def model_name(self) -> str | None:
        named = self.config.agent.model_name if self.config else None
        info = self.agent_info.model_info if self.agent_info else None
        return named or (info.name if info else None)

    @property
    def agent_steps(self) -> int | None:
        """The agent's steps: its own count in `agent_result.metadata`, else what a reader found."""
        from tmax.common.records import AgentMeta

        meta = AgentMeta.of(self.agent_result.metadata if self.agent_result else None)
        if meta is not None:
            return meta.steps
        return self.tmax.agent_steps if self.tmax else None

    @property
    def n_tokens(self) -> int:
        """Input and output tokens together (0 where the agent did not count them)."""
        ctx = self.agent_result
        return (ctx.n_input_tokens or 0) + (ctx.n_output_tokens or 0) if ctx else 0

    @property
    def wall_s(self) -> float | None:
        try:
            return (datetime.fromisoformat(self.finished_at) - datetime.fromisoformat(self.started_at)).total_seconds()
        except (TypeError, ValueError):
            return None


# --- a job's config.json --------------------------------------------------------------------
class DatasetConfig(Record):
    path: str | None = None
    name: str | None = None
    version: str | None = None


class JobConfig(Record):
    """A job's config.json. tmax's jobs add their own settings (`tmax_job`, the fields of
    `tasks.job.JobConfig`) and the identity their trials were named from."""

    schema_version: int = 1
    job_name: str | None = None
    jobs_dir: str | None = None
    n_attempts: int = 1
    n_concurrent_trials: int | None = None
    timeout_multiplier: float = 1.0
    agents: list[AgentConfig] = Field(default_factory=list)
    datasets: list[DatasetConfig] = Field(default_factory=list)
    environment: EnvironmentConfig | None = None
    tmax_identity: str | None = None
    tmax_job: dict[str, Any] | None = None

    @property
    def agent(self) -> AgentConfig | None:
        return self.agents[0] if self.agents else None


# --- a job's result.json --------------------------------------------------------------------
class AgentDatasetStats(Record):
    """Harbor's scores of one agent on one dataset (`stats.evals[AGENT__MODEL__SOURCE]`)."""

    n_trials: int = 0
    n_errors: int = 0
    metrics: list[dict[str, Any]] = Field(default_factory=list)
    pass_at_k: dict[str, float] = Field(default_factory=dict)
    reward_stats: dict[str, dict[str, list[str]]] = Field(default_factory=dict)
    exception_stats: dict[str, list[str]] = Field(default_factory=dict)


class JobStats(Record):
    n_completed_trials: int = 0
    n_errored_trials: int = 0
    n_running_trials: int = 0
    n_pending_trials: int = 0
    n_cancelled_trials: int = 0
    n_retries: int = 0
    evals: dict[str, AgentDatasetStats] = Field(default_factory=dict)
    n_input_tokens: int | None = None
    n_cache_tokens: int | None = None
    n_output_tokens: int | None = None
    cost_usd: float | None = None


class JobResult(Record):
    """A job's result.json; tmax's jobs add their scores (`tmax_score`: `tasks.scoring.Score`)."""

    schema_version: int = 1
    id: str
    started_at: str | None = None
    updated_at: str | None = None
    finished_at: str | None = None
    n_total_trials: int = 0
    stats: JobStats = Field(default_factory=JobStats)
    trial_results: list[dict[str, Any]] = Field(default_factory=list)
    tmax_score: dict[str, Any] | None = None
