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

A `tmax learn` run directory, `LearnRunDir`: metrics.jsonl, rollouts.jsonl, summary.json
(`RunSummary`), recipe.json, sft/sft.json (`SftRecord`), checkpoints/step_N/ with trainer_state.json
(`CheckpointMeta`) and health.json (`HealthRecord`). An engine's work directory keeps
weights.version.json (`WeightsManifest`). A generated corpus keeps `.generate/config.json`
(`GenerationIdentity`) and `_rejected/<task>/rejection.json` (`Rejection`). A generated
nano task's task.toml holds its `[metadata.nano]` table (`NanoMeta`).

A trial's result.json is Harbor's format (`tasks.harbor.TrialResult`), not one of these.
Every reader here takes the files older versions of tmax wrote (new fields have defaults).
"""

from __future__ import annotations

from tmax.common.records.record_io import (  # noqa: F401
    RecordError, read_record, read_optional, write_record, now_stamp, AgentStatus, RatingSource, HealthMark, R,
)
from tmax.common.records.layout import (  # noqa: F401
    SessionDir, LearnRunDir, CHECKPOINT_META, HEALTH, SFT_RECORD, WEIGHTS_MANIFEST,
)
from tmax.common.records.session_records import (  # noqa: F401
    EpisodeOutcome, AgentMeta, StepTiming, TimingRecords, SegmentRecord, UsageRecord, InstructionSource, RunRecord, Rating,
)
from tmax.common.records.learn_records import (  # noqa: F401
    metric, metric_values, GuardState, CheckpointExtra, AlarmRecord, GuardEvent, GuardEventKind, GuardSummary, TaskCounts, RunSummary, CheckpointMeta, HealthRecord, SftRecord, WeightsManifest, WeightGroupSpec, JoinedWeightGroup, WorkerReply,
)
from tmax.common.records.task_records import NanoMeta  # noqa: F401
from tmax.common.records.corpus_records import (  # noqa: F401
    JobItemResult, SolveAttempt, SolveSummary, InitialCheck, GenerationStatus, CorpusIdentity, GenerationIdentity, GeneratedEnvironment, GateRound, Rejection,
)
