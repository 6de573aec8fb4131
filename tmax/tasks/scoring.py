"""Scores of a job, by the Terminal-Bench / paper protocol.

* mean reward over all trials, errored trials counted as 0 (Harbor's `metrics.mean`);
* the same mean leaving infrastructure errors out (they are not the agent's failure);
* unbiased pass@k (Chen et al. 2021) per task over its scored attempts (infrastructure
  errors left out: they are not the agent's), averaged over tasks, for k = 1..K;
* a per-task table;
* a 95 % interval for a rate over tasks (`rate_interval`), with the method named: exact
  (Clopper-Pearson) when each task contributes one 0/1 outcome and the tasks are few,
  Wilson's score interval over tasks when they are few but a task's rate is a fraction
  (several attempts: a rate in [0, 1] varies no more than a 0/1 outcome with the same
  mean, so the interval is conservative), else a bootstrap over tasks with each task's
  attempts resampled inside it (the two levels of the protocol's randomness).
A trial's input row (`TrialRow`) carries what it scored by the one rule
(`tasks.harbor.TrialResult.score`): a trial "succeeds" for pass@k when the verifier's
reward is 1, whether or not the agent timed out; one without a reward counts 0.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from math import comb, sqrt
from random import Random
from typing import Any

from pydantic import TypeAdapter

from tmax.tasks.harbor import FAIL, INFRA_ERROR, PASS, TrialResult, TrialScore
# Below this many tasks a bootstrap cannot show the uncertainty (6 of 6 solved resamples to
# [100 %, 100 %]): the interval is exact (or Wilson's) instead.
FEW_TASKS = 30
BOOTSTRAP_SAMPLES = 2000
Z95 = 1.959963984540054
EXACT, WILSON, BOOTSTRAP = "exact Clopper-Pearson", "Wilson score", "bootstrap over tasks, attempts nested"


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} attempts, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve_decreasing(f, target: float) -> float:
    """The p in [0, 1] where the decreasing f(p) crosses `target` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo + hi) / 2


def clopper_pearson(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Exact binomial interval: the p whose tail probabilities of `successes` are alpha/2."""
    if n == 0:
        return (0.0, 1.0)
    lo = 0.0 if successes == 0 else _solve_decreasing(lambda p: _binom_cdf(successes - 1, n, p), 1 - alpha / 2)
    hi = 1.0 if successes == n else _solve_decreasing(lambda p: _binom_cdf(successes, n, p), alpha / 2)
    return (lo, hi)


def wilson(rate: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a rate observed over n units."""
    if n == 0:
        return (0.0, 1.0)
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def nested_bootstrap(per_task: list[tuple[int, int]], k: int, seed: int = 0,
                     samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float]:
    """95 % percentile interval of mean pass@k: tasks resampled with replacement, and each
    drawn task's n attempts resampled with replacement inside it."""
    rng = Random(seed)
    means = []
    for _ in range(samples):
        total = 0.0
        for _ in per_task:
            n, c = per_task[rng.randrange(len(per_task))]
            c_star = sum(rng.random() < c / n for _ in range(n)) if 0 < c < n else c
            total += pass_at_k(n, c_star, k)
        means.append(total / len(per_task))
    means.sort()
    return (means[int(0.025 * (samples - 1))], means[int(0.975 * (samples - 1))])


def rate_interval(per_task: list[tuple[int, int]], k: int = 1) -> tuple[tuple[float, float], str]:
    """95 % interval of mean pass@k over tasks given (attempts, successes) per task, and
    the method that made it (see the module docstring)."""
    if not per_task:
        return (0.0, 1.0), EXACT
    rates = [pass_at_k(n, c, k) for n, c in per_task]
    if len(per_task) < FEW_TASKS:
        if all(r in (0.0, 1.0) for r in rates):
            return clopper_pearson(int(sum(rates)), len(rates)), EXACT
        return wilson(sum(rates) / len(rates), len(rates)), WILSON
    return nested_bootstrap(per_task, k), BOOTSTRAP


@dataclass(frozen=True)
class TrialRow:
    """One finished trial as scoring sees it: its task, what it scored, its category."""

    task: str
    trial: str
    verdict: TrialScore
    category: str | None = None
    attempt: int | None = None

    @classmethod
    def of(cls, r: TrialResult) -> "TrialRow":
        t = r.tmax
        return cls(r.task_name, r.trial_name, r.score(), t.category if t else None, t.attempt if t else None)


@dataclass
class TaskRow:
    task: str
    category: str
    n: int
    successes: int
    mean_reward: float
    outcomes: dict[str, int]
    n_scored: int = 0  # attempts that were not infrastructure errors: pass@k's n


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
    pass_at_1_ci: tuple[float, float] | None = None  # 95 %, by `ci_method`
    ci_method: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Score":
        """A score as `to_dict` wrote it (a job's `tmax_score`)."""
        return TypeAdapter(cls).validate_python(data)


def score(trials: list[TrialRow], interval: bool = True) -> Score:
    """Scores of finished trials (`TrialRow`s). `interval=False` leaves out the pass@1
    interval (None), whose bootstrap costs ~0.1 s of CPU per call at 64 tasks: a running
    job rescores after every trial."""
    by_task: dict[str, list[TrialRow]] = defaultdict(list)
    for t in trials:
        by_task[t.task].append(t)
    outcomes = Counter(t.verdict.outcome for t in trials)
    non_infra = [t.verdict.credit for t in trials if not t.verdict.infra]
    rows = []
    for name in sorted(by_task):
        ts = by_task[name]
        rows.append(TaskRow(
            task=name,
            category=ts[0].category or "uncategorized",
            n=len(ts),
            successes=sum(t.verdict.passed for t in ts),
            mean_reward=sum(t.verdict.credit for t in ts) / len(ts),
            outcomes=dict(Counter(t.verdict.outcome for t in ts)),
            n_scored=sum(not t.verdict.infra for t in ts),
        ))
    # pass@k over each task's scored attempts, for every k that all scored tasks have enough for.
    scored = [r for r in rows if r.n_scored]
    kmax = min((r.n_scored for r in scored), default=0)
    pk = {k: sum(pass_at_k(r.n_scored, r.successes, k) for r in scored) / len(scored) for k in range(1, kmax + 1)}
    ci, method = rate_interval([(r.n_scored, r.successes) for r in scored], 1) if scored and interval else (None, None)
    cats: dict[str, list[float]] = defaultdict(list)
    for t in trials:
        cats[t.category or "uncategorized"].append(t.verdict.credit)
    return Score(
        n_trials=len(trials),
        n_tasks=len(rows),
        mean_reward=sum(t.verdict.credit for t in trials) / len(trials) if trials else 0.0,
        mean_reward_excl_infra=sum(non_infra) / len(non_infra) if non_infra else None,
        n_infra_errors=outcomes.get(INFRA_ERROR, 0),
        n_errors=sum(v for k, v in outcomes.items() if k not in (PASS, FAIL)),
        outcomes=dict(outcomes),
        pass_at_k=pk,
        tasks=rows,
        categories={c: sum(v) / len(v) for c, v in sorted(cats.items())},
        pass_at_1_ci=ci,
        ci_method=method,
    )
