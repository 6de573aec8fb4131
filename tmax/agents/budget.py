"""Budget hints (opt-in): what is left of the episode, appended to each observation.

Off by default, because the Vanillux2 protocol sends observations unchanged. When on
(`tmax run --budget-hints`, `budget_hints = true` in the bench agent kwargs or the learn
rollout config), each observation ends with one line such as

    [budget: 12 of 64 steps left · 3m20s of 15m00s left · 40.1k of 65.5k context tokens left]

and, once any of the three is nearly used up, a warning to wrap up and submit.
"""

from __future__ import annotations

from dataclasses import dataclass

# "Near the end": this fraction of a budget or less is left (and at most this many steps).
WARN_FRACTION = 0.1
WARN_STEPS = 3

WARNING_TEXT = (
    "[warning: the budget is nearly used up. Finish the most important part now and submit "
    "before it runs out.]"
)


@dataclass(frozen=True)
class Budget:
    """What one episode may use and what it has used so far."""

    max_steps: int
    steps_used: int
    context_budget: int
    context_used: int
    elapsed_s: float
    time_budget_s: float | None = None  # None: no time limit (elapsed time is shown)

    @property
    def steps_left(self) -> int:
        return max(0, self.max_steps - self.steps_used)

    @property
    def context_left(self) -> int:
        return max(0, self.context_budget - self.context_used)

    @property
    def time_left_s(self) -> float | None:
        return None if self.time_budget_s is None else max(0.0, self.time_budget_s - self.elapsed_s)

    @property
    def nearly_used_up(self) -> bool:
        few_steps = self.steps_left <= min(WARN_STEPS, max(1, int(self.max_steps * WARN_FRACTION)))
        little_context = self.context_left <= self.context_budget * WARN_FRACTION
        left = self.time_left_s
        little_time = left is not None and self.time_budget_s is not None and left <= self.time_budget_s * WARN_FRACTION
        return few_steps or little_context or little_time


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s"


def _tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else str(n)


def budget_hint(budget: Budget) -> str:
    """The text appended to an observation (starts with a blank line)."""
    if budget.time_left_s is None:
        time_part = f"{_duration(budget.elapsed_s)} elapsed, no time limit"
    else:
        time_part = f"{_duration(budget.time_left_s)} of {_duration(budget.time_budget_s or 0)} left"
    line = (
        f"[budget: {budget.steps_left} of {budget.max_steps} steps left · {time_part} · "
        f"{_tokens(budget.context_left)} of {_tokens(budget.context_budget)} context tokens left]"
    )
    if budget.nearly_used_up:
        line = f"{line}\n{WARNING_TEXT}"
    return f"\n\n{line}"
