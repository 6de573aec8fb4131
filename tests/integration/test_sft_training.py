"""SFT warm start trained for real: oracle demonstrations under two harnesses pass their
verifier and SFT lowers the loss into a loadable HF checkpoint; `tmax learn sft` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from documented import documented
from tiny_learner import small_nano
from tmax.agents.harnesses import HARNESSES
from tmax.training.config import preset
from tmax.training.demos import collect_demos
from tmax.training.learner.sft import train_sft


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    return small_nano(tmp_path_factory.mktemp("sft"))


def test_demos_pass_their_verifier_and_sft_learns(nano):
    tok, splits, root = nano
    cfg = preset("nano")
    cfg.sft.teacher_accuracy = 1.0  # the oracle: every demonstration must pass
    cfg.rollout.harness = ["tmax", "mini-swe"]  # demo i under harness i % 2
    cfg.sft.batch_size = 4
    cfg.sft.epochs = 6.0
    cfg.sft.lr = 3e-3
    demos = collect_demos([str(p) for p in splits["train"]], tok, cfg)
    assert len(demos) == 6 and all(d.reward == 1.0 and d.status == "submitted" for d in demos)
    assert [d.harness for d in demos] == ["tmax", "mini-swe"] * 3
    # Assistant tokens only: the loss mask covers the sampled turns, not the observations.
    for d in demos:
        assert 0 < d.num_sampled < len(d.trace.mask)
    res = train_sft(str(root / "base"), demos, cfg, root / "sft")

    losses = json.loads((Path(res.checkpoint) / "sft.json").read_text())["losses"]
    assert res.steps == len(losses) == 12  # ceil(6 / 4) batches x 6 epochs
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    # Every step ran with a thread count the cores allowed, and sft.json says which.
    assert sum(res.steps_by_threads.values()) == 12 and all(n >= 1 for n in res.steps_by_threads)
    assert json.loads((Path(res.checkpoint) / "sft.json").read_text())["steps_by_threads"] == {
        str(n): k for n, k in res.steps_by_threads.items()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(res.checkpoint)  # a loadable HF checkpoint
    assert AutoTokenizer.from_pretrained(res.checkpoint).chat_template == tok.chat_template


def test_learn_sft_warm_starts_under_a_list_of_harnesses(tmp_path, monkeypatch):
    """docs/learn.md's `tmax learn sft` as typed, end to end, the nano preset shrunk through
    its TMAX_LEARN_* variables and `rollout.harness` a list: the demonstrations rotate over
    the harnesses, every one solves its task, and SFT trains on all of them."""
    from typer.testing import CliRunner

    from tmax.cli.main import app

    env = {"TMAX_LEARN_TASKS__N_TRAIN": "3", "TMAX_LEARN_TASKS__N_HELDOUT": "1",
           "TMAX_LEARN_ROLLOUT__HARNESS": '["tmax", "mini-swe", "terminus-2"]', "TMAX_LEARN_ROLLOUT__MAX_TOKENS": "128",
           "TMAX_LEARN_ROLLOUT__RESPONSE_BUDGET": "1024", "TMAX_LEARN_ROLLOUT__CONTEXT_BUDGET": "2048",
           "TMAX_LEARN_SFT__TEACHER_ACCURACY": "1.0", "TMAX_LEARN_SFT__EPOCHS": "1.0", "TMAX_LEARN_SFT__BATCH_SIZE": "3"}
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, documented("tmax learn sft")[1:], env=env)
    assert res.exit_code == 0, res.output[-3000:]
    out = tmp_path / "runs" / "nano"  # the preset's run directory
    demos = [json.loads(line) for line in (out / "sft" / "demos.jsonl").read_text().splitlines()]
    assert [(d["group_id"], d["harness"]) for d in demos] == list(enumerate(HARNESSES))
    assert all(d["reward"] == 1.0 for d in demos)
    assert json.loads((out / "sft" / "sft.json").read_text())["demos"] == 3
