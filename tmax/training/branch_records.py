"""What a run records of its advantages per turn, and its branching figures per step.

`advantages.jsonl` (`LearnRunDir.advantages`): one `TurnAdvantages` row per episode trained
(a branching episode's leaves each), written when its step's batch is taken: the advantage of
each of its segments (`training.algo.tree`) and of each model turn (its segment's), and the
first turn it trains (the turns before it are a sibling's to train). A flat episode has one
segment: every turn the episode's advantage.

`branch_metrics`: the step's `branch/*` figures in metrics.jsonl.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tmax.training.algo.tree import first_owner_depth


class TurnAdvantages(BaseModel):
    step: int
    task_id: str
    group_id: int
    sample_index: int
    branch_path: list[int]  # the branch taken at each fork ([]: not forked)
    branch_turns: list[int]  # model turns done at each fork
    reward: float
    segment_advantages: list[float]  # one per stretch of turns between forks
    turn_advantages: list[float]  # one per model turn, in order
    trains_from_turn: int  # the first turn (1-based) this episode's loss covers


def turn_advantages(segments: list[float], branch_turns: list[int], turns: int) -> list[float]:
    """The advantage of each of `turns` model turns: turn k is in segment d when d forks came
    before it (`branch_turns[d - 1] < k`)."""
    return [segments[sum(1 for t in branch_turns if t < k)] for k in range(1, turns + 1)]


def advantage_records(batch: Any) -> list[str]:
    """The rows of one taken batch (`training.algo.batching.Batch`), as JSON lines."""
    rows = []
    for group, per_sample in zip(batch.groups, batch.segment_advantages):
        owners = first_owner_depth(group.paths) if group.paths is not None else [0] * len(per_sample)
        for r, segments, owner in zip(group.items, per_sample, owners):
            turns = max(r.steps, len(r.turn_outcomes))
            rows.append(TurnAdvantages(
                step=batch.step, task_id=r.task_id, group_id=r.group_id, sample_index=r.sample_index,
                branch_path=r.branch_path, branch_turns=r.branch_turns, reward=r.reward,
                segment_advantages=segments, turn_advantages=turn_advantages(segments, r.branch_turns, turns),
                trains_from_turn=([0, *r.branch_turns][owner] + 1)).model_dump_json())
    return rows


def branch_metrics(batch: Any, since: list[Any]) -> dict[str, float]:
    """Branching figures of a step: leaves per episode, forks and their seconds (every episode
    finished since the last step), and the mean |advantage| of the batch's segments by depth."""
    forked = [r for r in since if r.branch_path]
    if not forked:
        return {}
    episodes = {(r.group_id, r.sample_index) for r in since}
    fork_s = [s for r in forked for s in r.fork_s]
    out = {"branch/leaves_per_episode": len(since) / max(1, len(episodes)),
           "branch/fork_s_mean": sum(fork_s) / max(1, len(fork_s)),
           "branch/prefix_tokens_mean": sum(r.branch_at[-1] for r in forked) / len(forked)}
    by_depth: dict[int, list[float]] = {}
    for per_sample in batch.segment_advantages:
        for segments in per_sample:
            for d, a in enumerate(segments):
                by_depth.setdefault(d, []).append(abs(a))
    for d, values in sorted(by_depth.items()):
        out[f"branch/adv_abs_mean_depth{d}"] = sum(values) / len(values)
    return out
