"""The records of a `tmax learn` run: checkpoints' metadata and health, the guard's state,
the run's summary, SFT's result, an engine's weights manifest and its workers' replies."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from tmax.common.records.record_io import HealthMark, Record


class GuardState(Record):
    """The collapse guard's remedies, kept in each checkpoint so a resumed run keeps them."""

    rollbacks: int = 0
    lr_scale: float = 1.0
    group_size: int | None = None  # None: the config's


class CheckpointExtra(Record):
    """Where a resumed run continues (the prompt stream's and the rated sessions' positions,
    the guard's remedies); an SFT result says what trained it."""

    prompt_position: int = 0
    rated_position: int | None = None
    config: str | None = None  # the run config's name
    guard: GuardState = GuardState()
    sft_steps: int | None = None
    sft_demos: int | None = None


def metric(row: Mapping[str, Any], key: str) -> float | None:
    """One metric of a metrics row (a line of metrics.jsonl: metric name -> value, an open
    table), or None where the step logged none or no finite number (a NaN loss)."""
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def metric_values(rows: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    """`key`'s value in each row that logged one, in order."""
    return [v for r in rows if (v := metric(r, key)) is not None]


class GuardEventKind(StrEnum):
    ROLLBACK = "rollback"
    STOP = "stop"


class AlarmRecord(Record):
    """One signal that moved past its limit (`training.guard.Alarm`, as logged)."""

    signal: str
    value: float
    baseline: float
    threshold: float  # the change that was needed
    role: str = ""


class GuardEvent(Record):
    """What the collapse guard did at a step, logged in that step's metrics row
    (`guard/event`): went back to `to_step` with a remedy, or stopped the run."""

    kind: GuardEventKind
    step: int
    to_step: int | None = None  # None: a stop with no healthy checkpoint to stay on
    reason: str | None = None  # a stop's
    steps_lost: int = 0
    remedy: str | None = None  # a rollback's: lower_lr | raise_group_size | skip_batch
    lr_scale: float | None = None
    group_size: int | None = None
    rollback: int | None = None  # the rollback's number in the run
    alarms: list[AlarmRecord] = []


class GuardSummary(Record):
    """The collapse guard's rollbacks and stop over a run (summary.json's `guard`), from the
    events it logged in metrics.jsonl (`guard/event`)."""

    rollbacks: int = 0
    steps_lost: int = 0
    stopped: bool = False
    stop_reason: str | None = None
    events: list[GuardEvent] = []


class TaskCounts(Record):
    """The tasks a run's generator could run and the ones it dropped (`training.generator`)."""

    tasks_runnable: Annotated[int, Field(description="Tasks the run drew episodes from.")] = 0
    tasks_dropped: Annotated[int, Field(description="Tasks left out (no image, a broken task).")] = 0


def _quarter(what: str) -> FieldInfo:
    return Field(description=f"Mean {what}; None where no step logged it.")


class RunSummary(TaskCounts):
    """summary.json of a `tmax learn` RL run (`training.report.run_summary`, and the
    recipe.json's `rl.summary`): its length and times, the reward's and the turns' first and
    last quarter (a quarter of the steps), the infrastructure errors and the guard's events.
    A summary written by an older tmax lacks some of them (their defaults)."""

    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    steps: Annotated[int, Field(description="The run's last logged step.")] = 0
    updates: Annotated[int, Field(description="Steps trained, rolled-back ones included.")] = 0
    setup_s: Annotated[float, Field(description="The actors' start and the first weight sync, seconds.")] = 0.0
    run_s: Annotated[float, Field(description="The RL loop, seconds.")] = 0.0
    reward_first_quarter: Annotated[float | None, _quarter("training reward, first quarter")] = None
    reward_last_quarter: Annotated[float | None, _quarter("training reward, last quarter")] = None
    post_filter_reward_first_quarter: Annotated[float | None, _quarter("reward after the group filter, first quarter")] = None
    post_filter_reward_last_quarter: Annotated[float | None, _quarter("reward after the group filter, last quarter")] = None
    mask_frac_kept_mean: Annotated[float | None, _quarter("share of tokens the DPPO mask kept")] = None
    logprob_diff_max_mean: Annotated[float | None, _quarter("largest vLLM-vs-learner logprob gap per step")] = None
    train_step_s_mean: Annotated[float | None, _quarter("learner step, seconds")] = None
    weight_sync_s_mean: Annotated[float | None, _quarter("weight sync, seconds")] = None
    episodes: Annotated[int, Field(description="Episodes finished over the run.")] = 0
    turns_first_quarter: Annotated[float | None, _quarter("turns per episode, first quarter")] = None
    turns_last_quarter: Annotated[float | None, _quarter("turns per episode, last quarter")] = None
    turns_solved_last_quarter: Annotated[float | None, _quarter("turns per solved episode, last quarter")] = None
    max_steps_rate_last_quarter: Annotated[float | None, _quarter("share of episodes ended on the step budget, last quarter")] = None
    infra_errors: Annotated[int, Field(alias="env/infra_errors", description="Episodes lost to infrastructure errors.")] = 0
    infra_errors_by_kind: Annotated[dict[str, int], Field(description="Those errors by kind.")] = {}
    guard: Annotated[GuardSummary, Field(description="The collapse guard's rollbacks and stop.")] = GuardSummary()


class CheckpointMeta(Record):
    """trainer_state.json beside a checkpoint's weights (the tensors are trainer_state.pt)."""

    step: int
    time: float = 0.0
    extra: CheckpointExtra = CheckpointExtra()


class HealthRecord(BaseModel):
    """health.json: the guard's judgement of a checkpoint, with what it saw (extra keys)."""

    model_config = ConfigDict(extra="allow")

    mark: HealthMark
    time: float = 0.0


class SftRecord(Record):
    """sft/sft.json: what a finished SFT stage trained (a rerun skips the stage)."""

    steps: int
    demos: int
    losses: list[float] = []
    steps_by_threads: dict[int, int] = {}  # torch threads -> steps run with them (`learner.sft.CoreShare`)


class WeightsManifest(Record):
    """weights.version.json in an engine's work directory: the policy version of the weights
    (or adapter) last pushed through a file, for an engine restarted after its server died."""

    version: int


class WeightGroupSpec(Record):
    """What each vLLM worker of an engine is told to join a weight group by
    (`training.weights.vllm_ext`, as JSON: `/collective_rpc` takes strings)."""

    host: Annotated[str, Field(description="Learner rank 0's host, serving the group's TCPStore.")]
    port: Annotated[int, Field(description="That TCPStore's port.")]
    rank_offset: Annotated[int, Field(description="The engine's first rank; a worker adds its TP rank.")] = 0
    world_size: Annotated[int, Field(description="Ranks in the group: the learner's rank 0 and every engine worker.")]
    backend: Annotated[str, Field(description="gloo (host memory) or nccl (GPU).")] = "gloo"
    timeout_s: Annotated[float, Field(description="How long a collective may wait.")] = 300.0


class JoinedWeightGroup(WeightGroupSpec):
    """The weight group an engine's workers joined, with the ranks they took."""

    ranks: Annotated[list[int], Field(description="The ranks the engine's workers answered with.")] = []


class WorkerReply(Record):
    """What a vLLM worker of ours (`training.weights.vllm_ext`) answers to a load or a join."""

    n_tensors: int | None = None
    rank: int | None = None
