"""What a run records of its advantages per turn, and its branching figures per step.

`advantages.jsonl` (`LearnRunDir.advantages`): one `TurnAdvantages` row per episode trained
(a branching episode's leaves each), written when its step's batch is taken: the advantage of
each of its segments (`training.algo.tree`) and of each model turn (its segment's), and the
first turn it trains (the turns before it are a sibling's to train). A flat episode has one
segment: every turn the episode's advantage.

`branch_metrics`: the step's `branch/*` figures in metrics.jsonl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from tmax.training.algo.tree import first_owner_depth

if TYPE_CHECKING:
    from tmax.training.algo.batching import Batch
    from tmax.training.generator import Rollout


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


def advantage_records(batch: Batch) -> list[str]:
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


class Spend(BaseModel):
    """What episodes cost, each shared stretch counted once (the first leaf under a fork owns it,
    `first_owner_depth`): tokens sampled, and sandbox seconds (starts, forks, the commands, the
    verifier: the wall time sandboxes worked, not CPU time)."""

    episodes: int = 0  # requests that came back (a branching one is one, whatever its leaves)
    leaves: int = 0
    sampled_tokens: int = 0
    sandbox_s: float = 0.0

    @classmethod
    def of(cls, rollouts: list[Rollout]) -> Spend:
        trees: dict[tuple[int, int], list[Rollout]] = {}
        for r in rollouts:
            trees.setdefault((r.group_id, r.sample_index), []).append(r)
        out = cls(episodes=len(trees), leaves=len(rollouts))
        for leaves in trees.values():
            owners = first_owner_depth([(0, *r.branch_path) for r in leaves])
            for r, owner in zip(leaves, owners):
                start = [0, *r.branch_at][owner]
                out.sampled_tokens += sum(t.num_sampled for t in r.segments) + sum(r.trace.mask[start:])
                turns_before = [0, *r.branch_turns][owner]
                commands_before = sum(1 for o in r.turn_outcomes[:turns_before] if o not in ("format", "rejected"))
                t = r.timings
                out.sandbox_s += (sum(r.command_s[commands_before:]) + sum(r.fork_s[max(owner - 1, 0):])
                                  + t.get("verifier_s", 0.0) + (t.get("sandbox_start_s", 0.0) if owner == 0 else 0.0))
        return out


def branch_metrics(batch: Batch, since: list[Rollout]) -> dict[str, float]:
    """Branching figures of a step: leaves per episode, forks and their seconds (every episode
    finished since the last step), and the mean |advantage| of the batch's segments by depth."""
    forked = [r for r in since if r.branch_path]
    if not forked:
        return {}
    spend = Spend.of(since)
    fork_s = [s for r in forked for s in r.fork_s]
    out = {"branch/leaves_per_episode": spend.leaves / max(1, spend.episodes),
           "branch/sampled_tokens": float(spend.sampled_tokens), "branch/sandbox_s": spend.sandbox_s,
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
