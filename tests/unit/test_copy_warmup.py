"""Copy pre-training (`learner.copy_warmup`, `sft.copy_steps`): its sequences on the long
family's real tokenizer, and the recipe's stage training a real nano model through the
learner."""

from __future__ import annotations

import math
import random

import pytest


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from tmax.training.nano.model import build_nano_model

    path = tmp_path_factory.mktemp("copy") / "base"
    build_nano_model(path, seed=0, family="long")
    return path


def test_a_sequence_repeats_earlier_lines_and_marks_what_a_copy_predicts(long_model):
    from transformers import AutoTokenizer

    from tmax.training.learner.copy_warmup import copy_sequence
    from tmax.training.nano.tasks import value_pool

    tok = AutoTokenizer.from_pretrained(long_model)
    pool = value_pool("train", "long")
    ids, copyable, lines_ = copy_sequence(tok, pool, 3, 12, random.Random(0))
    assert lines_ == [1] * len(ids)  # no context asked: every token is a line's
    assert len(ids) == len(copyable)
    lines = tok.decode(ids).splitlines()
    assert len(lines) == 12 and lines[0].startswith("words: ")
    new = [line.split(": ")[1] for line in lines if line.startswith("words: ")]
    again = [line.split(": ")[1] for line in lines if line.startswith("again: ")]
    assert again and all(a in new for a in again) and len(new) + len(again) == 12
    assert all(len(v.split()) == 3 and all(w in pool for w in v.split()) for v in new)
    # The copyable tokens are a repeated line's values after the first value token: their
    # text is the repeated lines' values less each one's first syllable.
    text = tok.decode([t for t, c in zip(ids, copyable) if c])
    assert len(text) == sum(len(a) - 2 for a in again)
    # A value tokenizes alike in a sequence and in a task's command.
    w = new[0].split()[0]
    assert tok(f"cat {w}", add_special_tokens=False)["input_ids"][1:] == tok(f" {w}", add_special_tokens=False)["input_ids"]


def test_two_lines_are_a_line_and_its_repeat(long_model):
    from transformers import AutoTokenizer

    from tmax.training.learner.copy_warmup import copy_sequence
    from tmax.training.nano.tasks import value_pool

    tok = AutoTokenizer.from_pretrained(long_model)
    rng = random.Random(2)
    for _ in range(20):
        ids, copyable, _ = copy_sequence(tok, value_pool("train", "long"), 3, 2, rng)
        first, second = tok.decode(ids).splitlines()
        assert first.startswith("words: ") and second == "again: " + first.removeprefix("words: ")
        assert sum(copyable) > 0


def test_samples_train_every_token_or_the_copyable_ones(long_model):
    from transformers import AutoTokenizer

    from tmax.training.learner.copy_warmup import copy_samples, copy_sequence
    from tmax.training.nano.tasks import value_pool

    tok = AutoTokenizer.from_pretrained(long_model)
    pool = value_pool("train", "long")
    every = copy_samples(tok, pool, 3, 3, 8, random.Random(1))
    assert all(s.trace.num_sampled == len(s) - 1 and len(s.trace.prompt_ids) == 1 for s in every)
    only = copy_samples(tok, pool, 3, 3, 8, random.Random(1), repeat_only=True)
    rng = random.Random(1)
    for s_all, s_rep in zip(every, only):
        ids, copyable, _ = copy_sequence(tok, pool, 3, 8, rng)
        assert s_all.tokens == s_rep.tokens == ids
        assert s_rep.trace.mask == copyable[1:]


def test_context_puts_the_lines_into_prompt_text_with_no_loss_on_it(long_model):
    from transformers import AutoTokenizer

    from tmax.agents import prompts
    from tmax.training.learner.copy_warmup import context_ids, copy_samples, copy_sequence
    from tmax.training.nano.tasks import value_pool

    tok = AutoTokenizer.from_pretrained(long_model)
    pool = value_pool("train", "long")
    context = context_ids(tok)
    assert len(context) > 900
    # The held-out check's prefix is system-prompt text: the training context is other text.
    assert prompts.SYSTEM_TEMPLATE[:60] not in tok.decode(context)
    rng = random.Random(3)
    prefixes = []
    for _ in range(30):
        ids, copyable, lines = copy_sequence(tok, pool, 3, 6, rng, context, 900)
        assert len(ids) == len(copyable) == len(lines)
        # Copyable tokens are line tokens; the context tokens are slices of the context text.
        assert all(line for c, line in zip(copyable, lines) if c) and sum(copyable) > 0
        prefixes.append(lines.index(1))
        assert ids[:prefixes[-1]] == [] or tok.decode(ids[:prefixes[-1]]) in tok.decode(context)
        text = tok.decode([t for t, line in zip(ids, lines) if line])
        shown = [line for line in text.splitlines() if line]
        assert len(shown) == 6 and all(line.split(": ")[0] in ("words", "again") for line in shown)
    assert min(prefixes) < 150 and max(prefixes) > 600 and max(prefixes) <= 901
    # The loss is on the lines' tokens alone, never on the context.
    rng = random.Random(4)
    (sample,) = copy_samples(tok, pool, 1, 3, 6, rng, context=context, longest=900)
    ids, _, lines = copy_sequence(tok, pool, 3, 6, random.Random(4), context, 900)
    assert sample.tokens == ids and sample.trace.mask == lines[1:] and 0 < sum(sample.trace.mask) < len(ids) - 1


def test_the_pool_is_the_splits_own():
    from tmax.training.nano.long_tasks import LONG_POOLS
    from tmax.training.nano.tasks import value_pool

    assert value_pool("train", "long") == LONG_POOLS["train"]
    assert not set(value_pool("train", "long")) & set(value_pool("heldout", "long"))
    with pytest.raises(ValueError, match="unknown nano task family 'short'"):
        value_pool("train", "short")


def test_the_stage_trains_the_built_model_and_sft_starts_from_it(long_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from tmax.training.config import preset
    from tmax.training.recipe import copy_stage

    lines: list[str] = []
    assert copy_stage(preset("nano-long", {"sft": {"copy_steps": 0}}), str(long_model), tmp_path, lines.append) is None
    given = preset("nano-long", {"sft": {"copy_steps": 5}, "model": {"path": str(long_model)}})
    assert copy_stage(given, str(long_model), tmp_path, lines.append) is None  # a given model is pretrained

    cfg = preset("nano-long", {"sft": {"copy_steps": 12, "copy_short_steps": 6, "copy_batch_size": 4,
                                       "copy_context": 200}})
    res = copy_stage(cfg, str(long_model), tmp_path, lines.append)
    assert res is not None and res.steps == 12 and res.checkpoint == str(tmp_path / "copy")
    # From a random start (about ln 3,100 = 8 nats a token) the loss falls within 12 steps:
    # the fixed words and the syllables' frequencies are learned first, the copy later.
    assert res.final_loss is not None and res.final_loss < 7.0
    assert 0 < res.repeat_nll < math.log(3100)
    assert AutoModelForCausalLM.from_pretrained(res.checkpoint) is not None
    assert any(line.startswith("copy pre-training step 12/12") for line in lines)
    assert lines[-1].startswith("copy pre-training: 12 steps, loss on the repeated values")


def test_the_benchmark_measures_a_random_model_near_zero_and_needs_steps(long_model):
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("nano_copy_warmup", repo / "benchmarks" / "nano_copy_warmup.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = AutoTokenizer.from_pretrained(long_model)
    model = AutoModelForCausalLM.from_pretrained(long_model).eval()
    # A random model copies nothing: at most a stray syllable right (1 in ~70).
    assert 0.0 <= bench.copy_accuracy(model, tok, 300, 100, n=4) < 0.1
    proc = subprocess.run([sys.executable, "benchmarks/nano_copy_warmup.py", "--json"], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give --steps" in proc.stderr
