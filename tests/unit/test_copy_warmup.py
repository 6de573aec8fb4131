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


def test_a_sequence_repeats_its_values_token_for_token(long_model):
    from transformers import AutoTokenizer

    from tmax.training.learner.copy_warmup import copy_sequence
    from tmax.training.nano.tasks import value_pool

    tok = AutoTokenizer.from_pretrained(long_model)
    words = random.Random(0).sample(value_pool("train", "long"), 4)
    ids, repeat = copy_sequence(tok, words)
    assert tok.decode(ids) == f"words: {' '.join(words)}\nagain: {' '.join(words)}"
    body = ids[repeat:]
    assert ids[repeat - len(body) - 1:repeat] != body  # the repeat starts after "again:"
    # The values as they appear in a task's command: the same tokens as in the sequence.
    assert tok(f"cat {words[0]}", add_special_tokens=False)["input_ids"][1:] == \
        tok(f" {words[0]}", add_special_tokens=False)["input_ids"]
    assert tok.decode(body) == " " + " ".join(words)


def test_samples_train_every_token_or_the_repeat_alone(long_model):
    from transformers import AutoTokenizer

    from tmax.training.learner.copy_warmup import copy_samples
    from tmax.training.nano.tasks import value_pool

    tok = AutoTokenizer.from_pretrained(long_model)
    pool = value_pool("train", "long")
    every = copy_samples(tok, pool, 3, 4, random.Random(1))
    assert all(s.trace.num_sampled == len(s) - 1 and len(s.trace.prompt_ids) == 1 for s in every)
    only = copy_samples(tok, pool, 3, 4, random.Random(1), repeat_only=True)
    for s_all, s_rep in zip(every, only):
        assert s_all.tokens == s_rep.tokens
        n = s_rep.trace.num_sampled
        assert 0 < n < len(s_rep) // 2 and s_rep.trace.mask[-n:] == [1] * n


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

    cfg = preset("nano-long", {"sft": {"copy_steps": 12, "copy_batch_size": 8}})
    res = copy_stage(cfg, str(long_model), tmp_path, lines.append)
    assert res is not None and res.steps == 12 and res.checkpoint == str(tmp_path / "copy")
    # From a random start (about ln 3,100 = 8 nats a token) the loss falls within 12 steps:
    # the fixed words and the syllables' frequencies are learned first, the copy later.
    assert res.final_loss is not None and res.final_loss < 7.0
    assert 0 < res.repeat_nll < math.log(3100)
    assert AutoModelForCausalLM.from_pretrained(res.checkpoint) is not None
    assert any(line.startswith("copy pre-training step 12/12") for line in lines)
    assert lines[-1].startswith("copy pre-training: 12 steps, loss on the repeated values")
