"""Measures of the agentic part of episodes: how many turns they take (solved ones apart),
where in an episode the format errors and the failed commands fall, how often an episode
ends on its step budget, and (held-out) how the pass rate moves with the number of
dependent commands a task needs.

The same record (`EpisodeShape`) is made from an RL rollout (`of_rollout`, the step's
`agentic/*` metrics in metrics.jsonl) and from a held-out bench trial (`of_trial`, the
`agentic` field of the recipe's held-out evals in recipe.json)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from tmax.common.records import AgentMeta, NanoMeta

if TYPE_CHECKING:
    from tmax.tasks.harbor import TrialResult
    from tmax.training.rollout import Rollout

# An event at turn i of an episode of n turns falls in third min(2, 3 i // n).
THIRDS = ("early", "mid", "late")


class EpisodeShape(BaseModel):
    turns: int  # model turns, format errors and the submit included
    status: str  # how the loop ended: submitted | max_steps | context_overflow | format_errors | ...
    solved: bool
    turn_outcomes: list[str] = []  # per turn: ok | failed | format | rejected | sandbox_error
    depth: int | None = None  # commands the task needs (generated tasks; None: unknown)


def of_rollout(r: Rollout) -> EpisodeShape:
    """From a `training.rollout.Rollout`."""
    return EpisodeShape(turns=r.steps, status=r.status, solved=r.reward >= 1.0, turn_outcomes=r.turn_outcomes)


def _where(episodes: list[EpisodeShape], outcome: str) -> dict[str, float]:
    """Per episode, how many turns came to `outcome`, and the share of them in each third."""
    counts = [0, 0, 0]
    for e in episodes:
        n = len(e.turn_outcomes)
        for i, o in enumerate(e.turn_outcomes):
            if o == outcome:
                counts[min(2, 3 * i // n)] += 1
    total = sum(counts)
    out = {"per_episode": total / max(1, len(episodes))}
    if total:
        out |= {third: c / total for third, c in zip(THIRDS, counts)}
    return out


def agentic_metrics(episodes: list[EpisodeShape], prefix: str = "agentic/") -> dict[str, float]:
    """Turns per episode and per solved episode, the share that ended on the step budget
    (and on the context budget), and where format errors and failed commands fall."""
    if not episodes:
        return {}
    n = len(episodes)
    solved = [e.turns for e in episodes if e.solved]
    out = {
        "turns": sum(e.turns for e in episodes) / n,
        "max_steps_rate": sum(e.status == "max_steps" for e in episodes) / n,
        "context_end_rate": sum(e.status == "context_overflow" for e in episodes) / n,
    }
    if solved:
        out["turns_solved"] = sum(solved) / len(solved)
    for name, outcome in (("format_errors", "format"), ("failed_commands", "failed")):
        out |= {f"{name}_{k}": v for k, v in _where(episodes, outcome).items()}
    return {prefix + k: v for k, v in out.items()}


class DepthRate(BaseModel):
    passed: int
    trials: int
    pass_rate: float


def by_depth(episodes: list[EpisodeShape]) -> dict[str, DepthRate]:
    """Pass rate per number of dependent commands the task needs (episodes of known depth)."""
    groups: dict[int, list[bool]] = {}
    for e in episodes:
        if e.depth is not None:
            groups.setdefault(e.depth, []).append(e.solved)
    return {str(d): DepthRate(passed=sum(g), trials=len(g), pass_rate=round(sum(g) / len(g), 4))
            for d, g in sorted(groups.items())}


class HeldoutAgentic(BaseModel):
    """The agentic measures of one held-out eval (`recipe.HeldoutEval.agentic`)."""

    metrics: dict[str, float]  # `agentic_metrics` without the prefix

    @property
    def turns_solved(self) -> float | None:
        """Turns per solved trial; None when no trial was solved (the metric is left out)."""
        return self.metrics["turns_solved"] if "turns_solved" in self.metrics else None
    by_depth: dict[str, DepthRate]


def task_depth(task_dir: str | Path) -> int | None:
    """The commands a generated task needs (its `[metadata.nano] depth`; a one-command nano
    task written before depth was recorded: 1); None for a task that is not generated."""
    try:
        return NanoMeta.read(Path(task_dir)).depth
    except (ValueError, OSError):
        return None


def of_trial(t: TrialResult, depths: dict[str, int | None]) -> EpisodeShape | None:
    """From a bench `TrialResult` of the `tmax` agent (None for an infra error or a trial
    without the agent's record); `depths` caches each task's depth by task path."""
    verdict = t.score()
    meta = AgentMeta.of(t.agent_result.metadata if t.agent_result is not None else None)
    if verdict.infra or meta is None:
        return None
    path = str(t.task_id.path)
    if path not in depths:
        depths[path] = task_depth(path)
    return EpisodeShape(turns=meta.steps, status=meta.status, solved=verdict.passed,
                        turn_outcomes=meta.turn_outcomes, depth=depths[path])


def heldout_agentic(trials: list[TrialResult]) -> HeldoutAgentic:
    depths: dict[str, int | None] = {}
    shapes = [s for s in (of_trial(t, depths) for t in trials) if s is not None]
    return HeldoutAgentic(metrics=agentic_metrics(shapes, prefix=""), by_depth=by_depth(shapes))
