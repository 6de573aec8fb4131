"""Group advantages: centered (no std division) and standard."""

import math

import pytest

from tmax.training.algo.advantages import group_advantages, is_zero_std


def test_centered_is_reward_minus_group_mean_without_std():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # No std division: scaling the rewards scales the advantages.
    assert group_advantages([0.5, 0.0, 0.0, 0.0]) == pytest.approx([0.375, -0.125, -0.125, -0.125])
    assert sum(group_advantages([0.2, 0.9, 0.4])) == pytest.approx(0.0, abs=1e-12)


def test_standard_divides_by_population_std():
    rewards = [1.0, 0.0, 0.0, 0.0]
    std = math.sqrt(0.75**2 / 4 + 3 * 0.25**2 / 4)
    assert group_advantages(rewards, "standard") == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])


def test_zero_std_groups():
    assert is_zero_std([0.0, 0.0, 0.0])
    assert is_zero_std([1.0, 1.0])
    assert is_zero_std([0.3, 0.3, 0.3])  # the computed std may be 1e-17 here; equality is exact
    assert is_zero_std([0.7])
    assert not is_zero_std([0.0, 0.0, 1e-6])
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0], "standard") == [0.0, 0.0]


def test_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        group_advantages([])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="advantage mode"):
        group_advantages([1.0, 0.0], "maxrl_typo")
