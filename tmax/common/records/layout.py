"""The layout of a session directory and of a `tmax learn` run directory, each file named once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tmax.common.records.record_io import RecordError, read_optional, read_record
from tmax.common.records.session_records import EpisodeOutcome, RunRecord, StepTiming, TimingRecords, UsageRecord


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
    def advantages(self) -> Path:
        """Per trained episode, the advantage of each of its turns (`training.branch_records`)."""
        return self.dir / "advantages.jsonl"

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
