"""SFT warm start trained for real: oracle demonstrations under two harnesses pass their
verifier and SFT lowers the loss into a loadable HF checkpoint; `tmax learn sft` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(res.checkpoint)  # a loadable HF checkpoint
    assert AutoTokenizer.from_pretrained(res.checkpoint).chat_template == tok.chat_template


def test_learn_sft_warm_starts_under_a_list_of_harnesses(tmp_path):
    """`tmax learn sft` end to end with `rollout.harness` a list: the demonstrations rotate
    over the harnesses, every one solves its task, and SFT trains on all of them."""
    from typer.testing import CliRunner

    from tmax.cli.main import app

    config = tmp_path / "demos.toml"
    config.write_text(
        'extends = "nano"\n[tasks]\nn_train = 3\nn_heldout = 1\n'
        '[rollout]\nharness = ["tmax", "mini-swe", "terminus-2"]\n'
        "max_tokens = 128\nresponse_budget = 1024\ncontext_budget = 2048\n"
        "[sft]\nteacher_accuracy = 1.0\nepochs = 1.0\nbatch_size = 3\n")
    out = tmp_path / "learn"
    res = CliRunner().invoke(app, ["learn", "--config", str(config), "--out", str(out), "--no-progress", "sft"])
    assert res.exit_code == 0, res.output[-3000:]
    demos = [json.loads(line) for line in (out / "sft" / "demos.jsonl").read_text().splitlines()]
    assert [(d["group_id"], d["harness"]) for d in demos] == list(enumerate(HARNESSES))
    assert all(d["reward"] == 1.0 for d in demos)
    assert json.loads((out / "sft" / "sft.json").read_text())["demos"] == 3
