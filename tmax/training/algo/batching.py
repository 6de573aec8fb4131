"""Turning finished rollout groups into training batches.

`BatchAccumulator` is fed one finished group at a time (all samples of one prompt) and
decides, for the training step that will consume it:

* staleness: a group whose oldest sample started on weights more than `max_staleness`
  steps behind the consuming step is dropped (`stale_results_dropped`) and does not count;
* zero-std filtering: a group whose rewards are all equal carries no learning signal
  (every centered advantage is 0) and is dropped (`batch/filtered_prompts*`);
* active sampling: with it, dropped groups do not count towards the batch, so the caller
  keeps pulling groups until `groups_per_batch` usable ones are in; without it a filtered
  group still uses up a slot and the batch shrinks.

Every offered group, whatever its fate, is a consumed prompt: the caller enqueues one new
prompt per `offer` (prompt replenishment). Pure Python so the training loop can wrap it in
whatever process it likes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tmax.training.algo.advantages import ADVANTAGE_MODES, group_advantages, is_zero_std
from tmax.training.algo.tree import tree_advantages

KEPT, FILTERED, STALE = "kept", "filtered", "stale"


@dataclass
class Group:
    """All samples of one prompt. `items` are the per-sample payloads (rollout records,
    train samples), in the order of `rewards`; `policy_version` is the weights version the
    oldest sample of the group started with."""

    task_id: str
    rewards: list[float]
    items: list[Any] = field(default_factory=list)
    policy_version: int = 0
    # A branching group (`training.algo.tree`): each sample's leaf path (root index, then the
    # branch taken at each fork). None: independent samples.
    paths: list[tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError(f"group {self.task_id!r} has no samples")
        if self.items and len(self.items) != len(self.rewards):
            raise ValueError(
                f"group {self.task_id!r}: {len(self.items)} items but {len(self.rewards)} rewards"
            )
        if self.paths is not None and len(self.paths) != len(self.rewards):
            raise ValueError(f"group {self.task_id!r}: {len(self.paths)} paths but {len(self.rewards)} rewards")

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)


@dataclass
class BatchConfig:
    groups_per_batch: int = 8
    filter_zero_std: bool = True
    active_sampling: bool = True
    max_staleness: int | None = 4  # async steps; None = never drop for staleness
    advantage_mode: str = "centered"
    max_score: float = 1.0  # a zero-std group at this score counts as "solved"

    def __post_init__(self) -> None:
        if self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {self.groups_per_batch}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.advantage_mode not in ADVANTAGE_MODES:
            raise ValueError(f"advantage_mode must be one of {ADVANTAGE_MODES}, got {self.advantage_mode!r}")


@dataclass
class Batch:
    step: int
    groups: list[Group]
    advantages: list[list[float]]  # per kept group, per sample (a branching sample's: its last segment's)
    metrics: dict[str, float]
    # Per kept group, per sample, per segment (`training.algo.tree`; one segment for a flat sample).
    segment_advantages: list[list[list[float]]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.groups


class BatchAccumulator:
    def __init__(self, cfg: BatchConfig | None = None) -> None:
        self.cfg = cfg or BatchConfig()
        self._reset()

    def _reset(self) -> None:
        self._kept: list[Group] = []
        self._seen_means: list[float] = []  # mean reward of every non-stale group offered
        self._filtered = {"zero": 0, "solved": 0, "nonzero": 0}
        self._stale = 0

    def offer(self, group: Group, step: int) -> str:
        """Consider `group` for training step `step`; returns "kept", "filtered" or "stale"."""
        if self.full:
            raise RuntimeError("batch is already full: call take() before offering more groups")
        if self.cfg.max_staleness is not None and step - group.policy_version > self.cfg.max_staleness:
            self._stale += 1
            return STALE
        self._seen_means.append(group.mean_reward)
        if self.cfg.filter_zero_std and is_zero_std(group.rewards):
            score = group.rewards[0]
            kind = "zero" if score == 0 else "solved" if score >= self.cfg.max_score else "nonzero"
            self._filtered[kind] += 1
            return FILTERED
        self._kept.append(group)
        return KEPT

    @property
    def num_filtered(self) -> int:
        return sum(self._filtered.values())

    @property
    def full(self) -> bool:
        used = len(self._kept) if self.cfg.active_sampling else len(self._kept) + self.num_filtered
        return used >= self.cfg.groups_per_batch

    def take(self, step: int) -> Batch:
        """The batch for `step` (possibly short or empty without active sampling) and its
        metrics; the accumulator starts afresh."""
        groups = self._kept
        segments = [self._segment_advantages(g) for g in groups]
        advantages = [[seg[-1] for seg in per_sample] for per_sample in segments]
        flat_adv = [a for per_sample in segments for seg in per_sample for a in seg]
        kept_rewards = [r for g in groups for r in g.rewards]
        versions = [g.policy_version for g in groups]
        f = self._filtered
        metrics: dict[str, float] = {
            "batch/filtered_prompts": float(self.num_filtered),
            "batch/filtered_prompts_zero": float(f["zero"]),
            "batch/filtered_prompts_solved": float(f["solved"]),
            "batch/filtered_prompts_nonzero": float(f["nonzero"]),
            "batch/total_prompts": float(len(self._seen_means)),
            "stale_results_dropped": float(self._stale),
            "val/total_reward_groups": float(len(groups)),
            # Mean over every (non-stale) group, filtered ones included: the honest
            # training reward. Post-filter is what the paper's training curves plot.
            "val/avg_group_performance_pre_filter": _mean(self._seen_means),
            "val/avg_group_performance_post_filter": _mean([g.mean_reward for g in groups]),
            "scores": _mean(kept_rewards),
            "val/advantages_mean": _mean(flat_adv),
            "val/advantages_min": min(flat_adv, default=0.0),
            "val/advantages_max": max(flat_adv, default=0.0),
            "model_step_min": float(min(versions, default=step)),
            "model_step_max": float(max(versions, default=step)),
            "model_step_mean": _mean(versions) if versions else float(step),
        }
        self._reset()
        return Batch(step=step, groups=groups, advantages=advantages, metrics=metrics, segment_advantages=segments)

    def _segment_advantages(self, group: Group) -> list[list[float]]:
        """Per sample, per segment: the tree estimator for a branching group, else one segment
        with the group-relative advantage (`advantage_mode`)."""
        if group.paths is not None:
            return tree_advantages(group.paths, group.rewards)
        return [[a] for a in group_advantages(group.rewards, self.cfg.advantage_mode)]


def _mean(values: list[float] | list[int]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
