"""Scores of a job, by the Terminal-Bench / paper protocol.

* mean reward over all trials, errored trials counted as 0 (Harbor's `metrics.mean`);
* the same mean leaving infrastructure errors out (they are not the agent's failure);
* unbiased pass@k (Chen et al. 2021) per task, averaged over tasks, for k = 1..K;
* a per-task table.
A trial "succeeds" for pass@k when its reward is 1.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from math import comb

OUTCOMES = ("pass", "fail", "agent_timeout", "infra_error", "verifier_error")
SUCCESS = 1.0 - 1e-9


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} attempts, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class TaskRow:
    task: str
    category: str
    n: int
    successes: int
    mean_reward: float
    outcomes: dict[str, int]


@dataclass
class Score:
    n_trials: int
    n_tasks: int
    mean_reward: float  # errors counted as 0
    mean_reward_excl_infra: float | None
    n_infra_errors: int
    n_errors: int  # trials with any exception (infra, verifier, agent timeout)
    outcomes: dict[str, int]
    pass_at_k: dict[int, float]
    tasks: list[TaskRow] = field(default_factory=list)
    categories: dict[str, float] = field(default_factory=dict)  # mean reward per category

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return d


def score(trials: list[dict]) -> Score:
    """`trials`: dicts with `task`, `outcome`, `reward` (None when unscored), optional `category`."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for t in trials:
        by_task[t["task"]].append(t)
    rewards = [float(t["reward"]) if t.get("reward") is not None else 0.0 for t in trials]
    outcomes = Counter(t["outcome"] for t in trials)
    non_infra = [r for r, t in zip(rewards, trials) if t["outcome"] != "infra_error"]
    rows = []
    for name in sorted(by_task):
        ts = by_task[name]
        rs = [float(t["reward"]) if t.get("reward") is not None else 0.0 for t in ts]
        rows.append(TaskRow(
            task=name,
            category=ts[0].get("category") or "uncategorized",
            n=len(ts),
            successes=sum(r >= SUCCESS for r in rs),
            mean_reward=sum(rs) / len(rs),
            outcomes=dict(Counter(t["outcome"] for t in ts)),
        ))
    # pass@k for every k that all tasks have enough attempts for.
    kmax = min((r.n for r in rows), default=0)
    pk = {k: sum(pass_at_k(r.n, r.successes, k) for r in rows) / len(rows) for k in range(1, kmax + 1)}
    cats: dict[str, list[float]] = defaultdict(list)
    for r, t in zip(rewards, trials):
        cats[t.get("category") or "uncategorized"].append(r)
    return Score(
        n_trials=len(trials),
        n_tasks=len(rows),
        mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        mean_reward_excl_infra=sum(non_infra) / len(non_infra) if non_infra else None,
        n_infra_errors=outcomes.get("infra_error", 0),
        n_errors=sum(v for k, v in outcomes.items() if k not in ("pass", "fail")),
        outcomes=dict(outcomes),
        pass_at_k=pk,
        tasks=rows,
        categories={c: sum(v) / len(v) for c, v in sorted(cats.items())},
    )
