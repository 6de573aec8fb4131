"""Zero-std filtering, active sampling, staleness and batch metrics of BatchAccumulator."""

import pytest

from tmax.training.algo.batching import FILTERED, KEPT, STALE, BatchAccumulator, BatchConfig, Group


def g(name, rewards, version=0):
    return Group(task_id=name, rewards=list(rewards), items=[f"{name}/{i}" for i in range(len(rewards))], policy_version=version)


def test_active_sampling_pulls_until_enough_usable_groups():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=2, active_sampling=True, max_staleness=None))
    stream = [g("a", [0, 0, 0]), g("b", [1, 0, 1]), g("c", [1, 1, 1]), g("d", [0.5, 0.5, 0.5]), g("e", [0, 0, 1])]
    fates = []
    for grp in stream:
        fates.append(acc.offer(grp, step=0))
        if acc.full:
            break
    assert fates == [FILTERED, KEPT, FILTERED, FILTERED, KEPT]
    batch = acc.take(step=0)
    assert [x.task_id for x in batch.groups] == ["b", "e"]
    assert batch.advantages == [pytest.approx([1 / 3, -2 / 3, 1 / 3]), pytest.approx([-1 / 3, -1 / 3, 2 / 3])]
    m = batch.metrics
    assert m["batch/filtered_prompts"] == 3
    assert m["batch/filtered_prompts_zero"] == 1
    assert m["batch/filtered_prompts_solved"] == 1
    assert m["batch/filtered_prompts_nonzero"] == 1
    assert m["batch/total_prompts"] == 5
    assert m["val/total_reward_groups"] == 2
    assert m["val/avg_group_performance_pre_filter"] == pytest.approx((0 + 2 / 3 + 1 + 0.5 + 1 / 3) / 5)
    assert m["val/avg_group_performance_post_filter"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert m["stale_results_dropped"] == 0
    # The accumulator starts afresh after take().
    assert not acc.full
    assert acc.take(step=1).metrics["batch/filtered_prompts"] == 0


def test_without_active_sampling_filtered_groups_use_up_slots():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=2, active_sampling=False))
    assert acc.offer(g("a", [0, 0]), step=0) == FILTERED
    assert not acc.full
    assert acc.offer(g("b", [1, 1]), step=0) == FILTERED
    assert acc.full
    batch = acc.take(step=0)
    assert batch.empty and batch.advantages == []
    assert batch.metrics["val/avg_group_performance_pre_filter"] == 0.5


def test_filtering_off_keeps_zero_std_groups_with_zero_advantages():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=1, filter_zero_std=False))
    assert acc.offer(g("a", [1, 1]), step=0) == KEPT
    assert acc.take(0).advantages == [[0.0, 0.0]]


def test_staleness_drops_results_more_than_k_steps_behind():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=3, max_staleness=2))
    assert acc.offer(g("old", [0, 1], version=2), step=5) == STALE  # 3 behind
    assert acc.offer(g("edge", [0, 1], version=3), step=5) == KEPT  # exactly 2 behind: kept
    assert acc.offer(g("new", [1, 0], version=5), step=5) == KEPT
    assert acc.offer(g("stale0", [0, 0], version=0), step=5) == STALE  # dropped before filtering
    assert not acc.full  # stale groups do not count
    assert acc.offer(g("x", [1, 0, 0], version=4), step=5) == KEPT
    m = acc.take(step=5).metrics
    assert m["stale_results_dropped"] == 2
    assert m["batch/filtered_prompts"] == 0
    assert m["batch/total_prompts"] == 3
    assert (m["model_step_min"], m["model_step_max"]) == (3, 5)
    assert m["model_step_mean"] == pytest.approx(4.0)


def test_zero_staleness_means_on_policy_only():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=1, max_staleness=0))
    assert acc.offer(g("a", [0, 1], version=6), step=7) == STALE
    assert acc.offer(g("b", [0, 1], version=7), step=7) == KEPT


def test_offer_when_full_and_bad_input():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=1))
    acc.offer(g("a", [0, 1]), step=0)
    with pytest.raises(RuntimeError, match="already full"):
        acc.offer(g("b", [0, 1]), step=0)
    with pytest.raises(ValueError, match="no samples"):
        Group("c", [])
    with pytest.raises(ValueError, match="2 items but 3 rewards"):
        Group("d", [0, 1, 0], items=["x", "y"])
    with pytest.raises(ValueError, match="groups_per_batch"):
        BatchConfig(groups_per_batch=0)
    with pytest.raises(ValueError, match="advantage_mode"):
        BatchConfig(advantage_mode="nope")


def test_standard_advantages_selectable():
    acc = BatchAccumulator(BatchConfig(groups_per_batch=1, advantage_mode="standard"))
    acc.offer(g("a", [1, 0]), step=0)
    assert acc.take(0).advantages == [pytest.approx([1.0, -1.0], rel=1e-6)]


# ------------------------------------------------------------------ groups -> train samples


def rollout(reward, mask=(1, 1, 0, 1), group_id=0, sample_index=0):
    from tmax.agents.policy import TokenTrace
    from tmax.training.rollout import Rollout

    n = len(mask)
    trace = TokenTrace([1, 2], list(range(3, 3 + n)), [-0.5] * n, list(mask), [0, 1])
    return Rollout("t", group_id, sample_index, 0, trace, reward, "submitted", 2, 0, submitted=True)


def test_batch_samples_hold_the_traces_with_their_advantages_and_skip_unsampled():
    from tmax.training.learner.packing import batch_samples

    items = [rollout(1.0), rollout(0.0), rollout(0.0, mask=(0, 0))]
    a, b = Group("t", [1.0, 0.0, 0.0], items), Group("u", [0.0], [rollout(0.0)])
    out = batch_samples([a, b], [[2 / 3, -1 / 3, -1 / 3], [0.25]])
    assert [s.advantage for s in out] == pytest.approx([2 / 3, -1 / 3, 0.25])
    assert out[0].trace is items[0].trace and out[1].trace is items[1].trace  # held, not copied
    assert out[0].num_loss_tokens == 3 and len(out[0]) == 6
    with pytest.raises(ValueError, match="2 items but 1 advantages"):
        batch_samples([Group("v", [1.0, 0.0], items[:2])], [[0.5]])


def test_rollout_json_is_flat_and_round_trips():
    import json

    from tmax.training.rollout import Rollout

    r = rollout(1.0, group_id=3, sample_index=2)
    line = r.to_json()
    record = json.loads(line)
    assert record["mask"] == [1, 1, 0, 1] and record["turn_versions"] == [0, 1] and "trace" not in record
    assert Rollout.from_json(line) == r
