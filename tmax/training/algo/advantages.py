"""Group-relative advantages.

`centered` (the tmax / Dr.GRPO choice) is A_i = R_i - mean_g(R) over the whole group,
the sample itself included, with no division by the standard deviation: dividing by a
small std inflates the advantages of nearly-solved or nearly-failed groups.
`standard` is the classic GRPO (R - mean) / (std + eps) with the population std.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ADVANTAGE_MODES = ("centered", "standard")


def _check(rewards: Sequence[float]) -> list[float]:
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("a group needs at least one reward")
    bad = [r for r in values if not math.isfinite(r)]
    if bad:
        raise ValueError(f"rewards must be finite, got {bad}")
    return values


def is_zero_std(rewards: Sequence[float]) -> bool:
    """True when every reward of the group is identical (std exactly 0).

    Compared by equality rather than by a computed std, which can come out as 1e-17 for
    equal non-integer rewards."""
    values = _check(rewards)
    return max(values) == min(values)


def group_advantages(rewards: Sequence[float], mode: str = "centered", eps: float = 1e-8) -> list[float]:
    """Advantages of one group of samples of the same prompt."""
    values = _check(rewards)
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    if max(values) == min(values):
        return [0.0] * len(values)  # exact zeros, not rounding residue of the mean
    mean = sum(values) / len(values)
    if mode == "centered":
        return [r - mean for r in values]
    std = math.sqrt(sum((r - mean) ** 2 for r in values) / len(values))
    return [(r - mean) / (std + eps) for r in values]
