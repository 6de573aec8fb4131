"""Training data from `tmax run` sessions (`tmax run --tokens`, rated with /good, /bad or
--verify): the recorded tokens.json is the same TokenTrace a `tmax learn` rollout keeps.

* `tmax learn sft --from-runs DIR`: SFT on the accepted sessions (reward > 0.5).
* `tmax learn --from-runs DIR`: every RL step also trains on the next rated sessions, each
  a group of one. Estimator: A = R - 0.5, a fixed baseline. A group of one has no group
  mean to center on (the group estimator gives A = 0, and the zero-std filter drops it);
  with binary rewards 0.5 is the midpoint, so /good and /bad push by the same +-0.5 as
  the samples of a half-solved task group. A running mean of the task rewards was not
  used: it would make a user's verdict count for little or even flip sign depending on
  how the unrelated task stream is going (near 1.0 once the tasks are mostly solved).

A session that compacted is several token segments (`segments/segment-N.json`, then
tokens.json): each is a sample of its own with the session's reward, its prompt ids the
context as sent and its sampled ids as sampled (`Rollout.traces`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmax.agents.rating import read_reward
from tmax.agents.recorder import load_segments
from tmax.agents.policy import TokenTrace
from tmax.common.records import AgentStatus, RecordError, SessionDir
from tmax.training.algo.batching import Group
from tmax.training.learner.packing import TrainSample, batch_samples
from tmax.training.rollout import Rollout

RATED_BASELINE = 0.5
ACCEPT_ABOVE = 0.5


class RunsDataError(ValueError):
    """The runs directory holds nothing usable, or a session's files are broken."""


@dataclass
class RatedRun:
    dir: Path
    reward: float | None  # None: never rated
    rollout: Rollout
    model_dir: str | None  # the served model's directory, from run.json


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunsDataError(f"{path} is not readable JSON: {e}") from None


def load_run(run_dir: Path) -> RatedRun:
    files = SessionDir(run_dir)
    trace = TokenTrace(**_read(files.tokens))
    try:
        segments = [s.trace for s in load_segments(run_dir) if s.trace is not None]
    except (ValueError, KeyError, TypeError) as e:
        raise RunsDataError(f"{run_dir}: a compacted segment is broken: {e}") from None
    for t in (*segments, trace):
        if not (len(t.ids) == len(t.mask) == len(t.logprobs)):
            raise RunsDataError(f"{run_dir}: ids, mask and logprobs of a token segment differ in length")
    try:
        outcome, meta = files.read_outcome(), files.read_run()
    except RecordError as e:
        raise RunsDataError(str(e)) from None
    reward = read_reward(run_dir)
    rollout = Rollout(
        task_id=f"run:{run_dir.name}", group_id=-1, sample_index=0, seed=0, trace=trace,
        reward=reward if reward is not None else 0.0, status=outcome.status if outcome else AgentStatus.UNKNOWN,
        steps=outcome.steps if outcome else len(trace.turn_versions),
        policy_version=min((v for t in (*segments, trace) for v in t.turn_versions), default=0),
        segments=segments,
    )
    return RatedRun(run_dir, reward, rollout, meta.model_dir if meta else None)


def load_runs(root: str | Path) -> list[RatedRun]:
    """Every session under `root` (itself a run directory, or a directory of them, any depth)
    that kept tokens.json; sorted by path so the order is reproducible."""
    root = Path(root)
    if not root.is_dir():
        raise RunsDataError(f"--from-runs: {root} is not a directory")
    tokens = SessionDir(root).tokens.name
    dirs = sorted({p.parent for p in root.rglob(tokens)})
    if not dirs:
        raise RunsDataError(f"--from-runs: no session under {root} has {tokens} (record them with `tmax run --tokens`)")
    return [load_run(d) for d in dirs]


def accepted(runs: list[RatedRun]) -> list[Rollout]:
    """Sessions rated above 0.5 (/good, a passing --verify) with sampled tokens: SFT data."""
    return [r.rollout for r in runs if r.reward is not None and r.reward > ACCEPT_ABOVE and r.rollout.num_sampled > 0]


def model_dir_of(runs: list[RatedRun]) -> str:
    """The one model the sessions were sampled from (`run.json` model_dir)."""
    dirs = {r.model_dir for r in runs if r.model_dir}
    if len(dirs) != 1:
        raise RunsDataError(f"the sessions name {len(dirs)} model directories ({sorted(dirs)}); "
                            "set model.path in the config to choose the one to train")
    return dirs.pop()


@dataclass
class RatedBatch:
    """The rated sessions one RL step adds: their samples and what the step's metrics row
    says about them."""

    samples: list[TrainSample]
    rewards: list[float]

    @property
    def metrics(self) -> dict[str, float]:
        return {"train/rated_sessions": float(len(self.rewards)),
                "train/rated_reward_mean": sum(self.rewards) / max(1, len(self.rewards))}


class RatedStream:
    """The rated sessions as extra single-sample groups, `per_step` of them per RL step,
    in a fixed cycle; `position` (sessions handed out so far) is saved in checkpoints so a
    resumed run continues the cycle."""

    def __init__(self, runs: list[RatedRun], per_step: int = 1, baseline: float = RATED_BASELINE,
                 position: int = 0) -> None:
        self.rated = [r for r in runs if r.reward is not None and r.rollout.num_sampled > 0]
        if not self.rated:
            raise RunsDataError("no rated session with sampled tokens (rate them with /good, /bad or --verify)")
        self.per_step = per_step
        self.baseline = baseline
        self.position = position

    def next_batch(self) -> RatedBatch:
        """The next `per_step` sessions, each a group of one with A = R - baseline."""
        picked = [self.rated[(self.position + k) % len(self.rated)] for k in range(min(self.per_step, len(self.rated)))]
        self.position += len(picked)
        rewards = [float(r.reward) for r in picked]
        groups = [Group(r.rollout.task_id, [reward], [r.rollout]) for r, reward in zip(picked, rewards)]
        return RatedBatch(batch_samples(groups, [[reward - self.baseline] for reward in rewards]), rewards)
