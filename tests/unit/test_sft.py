"""SFT warm start: oracle demonstrations through the harness (`training.demos`), then real
torch training on them (`training.learner.sft`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tmax.agents.harnesses import HARNESSES
from token_spans import spans as _spans
from tmax.training.config import preset
from tmax.training.demos import (
    DemoError, ScriptedSampler, collect_demos, oracle_demo, scripted_turns, select_sft_tasks,
)
from tmax.training.learner.sft import train_sft
from tmax.training.rollout import EpisodeSettings


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    from transformers import AutoTokenizer

    from tmax.training.nano.model import NanoSpec, build_nano_model
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("sft")
    # A smaller model than the recipe's keeps this test fast; same architecture.
    build_nano_model(root / "base", seed=0, spec=NanoSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2))
    splits = write_splits(root / "tasks", 6, 2, seed=0)
    return AutoTokenizer.from_pretrained(root / "base"), splits, root


def test_assistant_turn_is_the_template_rendering(nano):
    tok, _, _ = nano
    [ids] = scripted_turns(tok, [("THOUGHT: Sort the lines.", "sort a.txt > b.txt")])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("THOUGHT: Sort the lines.\n<tool_call>\n")
    assert '"command": "sort a.txt > b.txt"' in text and text.endswith("</tool_call><|im_end|>")


def test_scripted_sampler_respects_turn_budget(nano):
    tok, _, _ = nano
    [ids] = scripted_turns(tok, [("THOUGHT: x.", "ls")])
    with pytest.raises(DemoError, match="per-turn budget"):
        ScriptedSampler([ids]).sample([1], len(ids) - 1, 1.0, 1.0)


@pytest.mark.parametrize("harness", HARNESSES)
def test_oracle_demo_under_each_harness(nano, harness):
    """A demonstration is written as the harness's model would write it (terminus-2: JSON
    keystrokes, and the confirming second `task_complete`), scores 1, and its trace holds
    those turns verbatim as the sampled spans; the rest is the template's observations."""
    from tmax.training.nano.tasks import oracle_steps

    tok, splits, _ = nano
    cfg = preset("nano")
    cfg.rollout.harness = harness
    # Terminus-2's JSON turns and screens take more tokens than the nano preset allows.
    cfg.rollout.per_turn_max_tokens, cfg.rollout.response_budget, cfg.rollout.context_budget = 128, 1024, 2048
    task = splits["train"][0]
    r = oracle_demo(task, tok, EpisodeSettings.of(cfg.rollout))
    assert (r.harness, r.status, r.reward) == (harness, "submitted", 1.0)
    turns = scripted_turns(tok, oracle_steps(task), harness)
    assert len(turns) == len(oracle_steps(task)) + (harness == "terminus-2")
    spans = _spans(r.trace.mask)
    assert [r.trace.ids[s:e] for v, s, e in spans if v == 1] == turns
    assert r.trace.logprobs == [0.0] * len(r.trace.ids)
    for v, s, e in spans:
        if v == 0:
            text = tok.decode(r.trace.ids[s:e], skip_special_tokens=False)
            assert text.startswith("\n<|im_start|>") and text.endswith("<|im_start|>assistant\n")


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


def test_partial_task_selection_is_seeded(nano):
    _, splits, _ = nano
    dirs = [str(p) for p in splits["train"]]
    a = select_sft_tasks(dirs, 0.5, 1)
    assert a == select_sft_tasks(dirs, 0.5, 1) and len(a) == 3 and set(a) <= set(dirs)


def test_teacher_demos_keep_their_failures_and_are_seeded(nano):
    """Below accuracy 1 the demonstrations are played by the sloppy teacher: its failed
    episodes are kept (scored 0 by the real verifier), and the choice is reproducible."""
    tok, splits, root = nano
    cfg = preset("nano")
    cfg.sft.teacher_accuracy = 0.5
    dirs = [str(p) for p in splits["train"]]
    a = collect_demos(dirs, tok, cfg)
    b = collect_demos(dirs, tok, cfg)
    assert [r.reward for r in a] == [r.reward for r in b] and [r.ids for r in a] == [r.ids for r in b]
    assert {r.reward for r in a} == {0.0, 1.0}, [r.reward for r in a]  # seed 0 draws both with 6 tasks
    assert all(r.status == "submitted" for r in a)


def test_learn_sft_warm_starts_under_a_list_of_harnesses(tmp_path):
    """`tmax learn sft` end to end with `rollout.harness` a list: the demonstrations rotate
    over the harnesses, every one solves its task, and SFT trains on all of them."""
    from typer.testing import CliRunner

    from tmax.cli.main import app

    config = tmp_path / "demos.toml"
    config.write_text(
        'extends = "nano"\n[tasks]\nn_train = 3\nn_heldout = 1\n'
        '[rollout]\nharness = ["tmax", "mini-swe", "terminus-2"]\n'
        "per_turn_max_tokens = 128\nresponse_budget = 1024\ncontext_budget = 2048\n"
        "[sft]\nteacher_accuracy = 1.0\nepochs = 1.0\nbatch_size = 3\n")
    out = tmp_path / "learn"
    res = CliRunner().invoke(app, ["learn", "--config", str(config), "--out", str(out), "--no-progress", "sft"])
    assert res.exit_code == 0, res.output[-3000:]
    demos = [json.loads(line) for line in (out / "sft" / "demos.jsonl").read_text().splitlines()]
    assert [(d["group_id"], d["harness"]) for d in demos] == list(enumerate(HARNESSES))
    assert all(d["reward"] == 1.0 for d in demos)
    assert json.loads((out / "sft" / "sft.json").read_text())["demos"] == 3
