"""Branching groups (`rollout.branching`): the tree estimator (`training.algo.tree`), and the
tree -> batch -> packed row construction: per-segment advantages on each token, each shared
token trained once, each shared prefix computed once by the learner's trie."""

from __future__ import annotations

import pytest

from tmax.agents.policy import TokenTrace
from tmax.training.algo.batching import BatchAccumulator, BatchConfig, Group
from tmax.training.algo.tree import first_owner_depth, node_values, tree_advantages
from tmax.training.branch_records import TurnAdvantages, advantage_records, turn_advantages
from tmax.training.generator import Rollout
from tmax.training.learner.packing import batch_samples, build_pack


def nested(rows: list[list[float]]) -> list:
    return [pytest.approx(r) for r in rows]


def test_one_fork_credits_the_prefix_by_its_continuations_and_each_continuation_by_its_siblings():
    # Two roots forked once into two: root 0's continuations score 1 and 0, root 1's 0 and 0.
    paths = [(0, 0), (0, 1), (1, 0), (1, 1)]
    adv = tree_advantages(paths, [1.0, 0.0, 0.0, 0.0])
    # V(0) = 0.5, V(1) = 0, V(group) = 0.25.
    assert adv == nested([[0.25, 0.5], [0.25, -0.5], [-0.25, 0.0], [-0.25, 0.0]])
    # The turns of root 1 after its fork are not blamed: both siblings failed alike.
    assert node_values(paths, [1.0, 0.0, 0.0, 0.0])[()] == pytest.approx(0.25)


def test_without_forks_it_is_the_flat_centered_advantage():
    from tmax.training.algo.advantages import group_advantages

    rewards = [1.0, 0.0, 0.5, 0.0]
    flat = tree_advantages([(i,) for i in range(4)], rewards)
    assert [a[0] for a in flat] == pytest.approx(group_advantages(rewards))


def test_children_weigh_equally_so_a_lost_branch_does_not_tilt_its_parent():
    # Root 0 lost one of its three branches (infra): its value is the mean of the two left;
    # root 1 ended before the fork (a leaf at depth 1).
    paths = [(0, 0), (0, 2), (1,)]
    adv = tree_advantages(paths, [1.0, 0.0, 1.0])
    assert adv == nested([[-0.25, 0.5], [-0.25, -0.5], [0.25]])


def test_two_levels_and_equal_rewards():
    paths = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    adv = tree_advantages(paths, [1.0, 1.0, 1.0, 0.0])
    # V(00) = 1, V(01) = .5, V(0) = .75 = V(group): the root stretch gets 0.
    assert adv == nested([[0, 0.25, 0], [0, 0.25, 0], [0, -0.25, 0.5], [0, -0.25, -0.5]])
    assert tree_advantages(paths, [0.3] * 4) == [[0.0] * 3] * 4  # exact zeros


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="one reward per leaf"):
        tree_advantages([(0,)], [1.0, 0.0])
    with pytest.raises(ValueError, match="same path"):
        tree_advantages([(0, 1), (0, 1)], [1.0, 0.0])
    with pytest.raises(ValueError, match="not a leaf"):
        tree_advantages([(0,), (0, 1)], [1.0, 0.0])


def test_the_first_leaf_under_a_node_trains_its_tokens():
    paths = [(0, 1), (0, 0), (1,), (2, 0, 1), (2, 1, 0), (2, 0, 0)]
    assert first_owner_depth(paths) == [1, 0, 0, 2, 1, 0]


def _leaf(sample: int, path: list[int], reward: float, prefix: list[int], own: list[int], at: list[int],
          turns: list[int]) -> Rollout:
    """A leaf whose ids are the shared `prefix` (sampled) then its `own` sampled tokens."""
    ids = prefix + own
    trace = TokenTrace([1, 2], ids, [-0.5] * len(ids), [1] * len(ids), [0, 0])
    return Rollout("t", 7, sample, 0, trace, reward, "submitted", 3, 0, submitted=True, turn_outcomes=["ok"] * 3,
                   branch_path=path, branch_at=at, branch_turns=turns)


def test_a_branching_group_becomes_samples_with_per_segment_advantages_and_one_prefix():
    # Root 0 forked after 2 tokens (its first turn) into two continuations; root 1 ended before.
    leaves = [_leaf(0, [0], 1.0, [10, 11], [20, 21, 22], [2], [1]),
              _leaf(0, [1], 0.0, [10, 11], [30, 31], [2], [1]),
              _leaf(1, [], 0.0, [], [40, 41, 42], [], [])]
    group = Group("t", [r.reward for r in leaves], leaves, 0, [(r.sample_index, *r.branch_path) for r in leaves])
    acc = BatchAccumulator(BatchConfig(groups_per_batch=1))
    acc.offer(group, 0)
    batch = acc.take(0)
    # V(0) = .5, V(1) = 0, V(group) = .25.
    assert batch.segment_advantages == [nested([[0.25, 0.5], [0.25, -0.5], [-0.25]])]
    assert batch.advantages == [pytest.approx([0.5, -0.5, -0.25])]

    samples = batch_samples(batch.groups, batch.segment_advantages)
    assert [s.owned_from for s in samples] == [0, 2, 0]  # leaf 1's prefix is leaf 0's to train
    assert [s.num_loss_tokens for s in samples] == [5, 2, 3]
    assert samples[0].token_advantages() == pytest.approx([0.25, 0.25, 0.5, 0.5, 0.5])

    pack = build_pack(samples, [0, 1, 2])
    # The trie holds the shared prompt + prefix once: 2 + 2 + 3 + 2 nodes, and root 1's 3 tokens
    # after the shared prompt.
    assert len(pack.trie) == 2 + 2 + 3 + 2 + 3
    assert pack.trie.paths[0][:4] == pack.trie.paths[1][:4]
    # Every loss token once: 10 sampled tokens, 2 of them (leaf 1's prefix) context only.
    assert float(pack.loss_mask.sum()) == 10
    loss_adv = [a for a, m in zip(pack.advantages.tolist(), pack.loss_mask.tolist()) if m]
    assert loss_adv == pytest.approx([0.25, 0.25, 0.5, 0.5, 0.5, -0.5, -0.5, -0.25, -0.25, -0.25])

    rows = [TurnAdvantages.model_validate_json(line) for line in advantage_records(batch)]
    assert [r.turn_advantages for r in rows] == [pytest.approx([0.25, 0.5, 0.5]), pytest.approx([0.25, -0.5, -0.5]),
                                                  pytest.approx([-0.25] * 3)]
    assert [r.trains_from_turn for r in rows] == [1, 2, 1]


def test_what_a_tree_spent_counts_each_shared_stretch_once():
    from tmax.training.branch_records import Spend

    leaves = [_leaf(0, [0], 1.0, [10, 11], [20, 21, 22], [2], [1]),
              _leaf(0, [1], 0.0, [10, 11], [30, 31], [2], [1]),
              _leaf(1, [], 0.0, [], [40, 41, 42], [], [])]
    for r, commands, fork in zip(leaves, ([1.0, 2.0, 3.0], [1.0, 5.0, 7.0], [4.0, 4.0, 4.0]), ([0.5], [0.25], [])):
        r.command_s, r.fork_s = commands, fork
        r.timings = {"sandbox_start_s": 10.0, "verifier_s": 0.1}
    spend = Spend.of(leaves)
    assert (spend.episodes, spend.leaves, spend.sampled_tokens) == (2, 3, 5 + 2 + 3)
    # Root 0: its start, its 3 commands, fork .5, a verifier; its sibling: commands after turn 1,
    # its fork, a verifier; root 1: its start, its commands, a verifier.
    assert spend.sandbox_s == pytest.approx((10 + 6 + 0.5 + 0.1) + (12 + 0.25 + 0.1) + (10 + 12 + 0.1))


def test_turn_advantages_follow_the_forks():
    assert turn_advantages([0.1, 0.2, 0.3], [2, 4], 6) == [0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    assert turn_advantages([0.5], [], 3) == [0.5] * 3


def test_a_leaf_whose_segments_do_not_match_its_forks_is_refused():
    leaf = _leaf(0, [0], 1.0, [10], [20], [1], [1])
    group = Group("t", [1.0], [leaf], 0, [(0, 0)])
    with pytest.raises(ValueError, match="2 segments"):
        batch_samples([group], [[[0.5]]])


def test_branching_settings_that_cannot_run_are_refused():
    from pydantic import ValidationError

    from tmax.training.config import BranchingConfig, LearnConfig, preset

    base = preset("nano-long").model_dump()
    ok = LearnConfig.model_validate({**base, "rollout": {**base["rollout"],
                                                         "branching": {"enabled": True, "at_turns": [2, 4]}}})
    assert ok.rollout.branching.leaves == 4 and BranchingConfig().leaves == 1
    for branching, why in (({"at_turns": [3, 2]}, "increasing"), ({"at_turns": [0]}, "increasing"),
                           ({"branches": 1}, "greater than or equal to 2"),
                           ({"enabled": True, "at_turns": [10]}, "below rollout.max_steps")):
        with pytest.raises(ValidationError, match=why):
            LearnConfig.model_validate({**base, "rollout": {**base["rollout"], "branching": branching}})
    with pytest.raises(ValidationError, match="tasks.format"):
        LearnConfig.model_validate({**base, "tasks": {**base["tasks"], "format": "text"},
                                    "rollout": {**base["rollout"], "branching": {"enabled": True}}})
    with pytest.raises(ValidationError, match="compaction = false"):
        LearnConfig.model_validate({**base, "rollout": {**base["rollout"], "compaction": True,
                                                        "branching": {"enabled": True}}})
