"""The prefix trie (pure) and the learner computing a micro-batch as one: loss and every
parameter's gradient equal the per-sample computation (fp32, DPPO mask and fp32 LM head
on), on RL groups and on SFT batches."""

import random

import pytest
import torch

from tmax.agents.policy import TokenTrace
from tmax.training.algo.dppo import LossConfig, policy_loss
from tmax.training.algo.prefix_trie import build_trie, pack_by_prefix, shared_prefix_len
from tmax.training.learner.learner import Learner, LearnerConfig
from tmax.training.learner.packing import TrainSample, build_pack, pack_samples
from tmax.training.learner.sft import sft_loss

from tiny_learner import VOCAB, make_model_dir

# ------------------------------------------------------------------ the trie alone


def test_trie_stores_each_prefix_once_and_every_path_spells_its_sequence():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [1, 2, 3], [7], [1, 2, 3, 4, 6]]
    trie = build_trie(seqs)
    # Distinct prefixes: 1, 12, 123, 1234, 12346, 125, 7.
    assert len(trie) == 7
    for seq, path in zip(seqs, trie.paths):
        assert [trie.tokens[n] for n in path] == seq
        assert [trie.depths[n] for n in path] == list(range(len(seq)))
        assert [trie.parents[n] for n in path] == [-1, *path[:-1]]
    assert trie.paths[0] == trie.paths[2]  # identical sequences share every node
    assert trie.paths[3] == trie.paths[0][:3]  # a sequence that prefixes another adds none


def test_nodes_are_depth_first_and_chains_tile_them():
    rng = random.Random(0)
    system = [rng.randrange(50) for _ in range(20)]
    seqs = [system + [g] * 5 + [rng.randrange(50) for _ in range(rng.randrange(1, 6))] for g in range(3) for _ in range(4)]
    trie = build_trie(seqs)
    for n, parent in enumerate(trie.parents):
        assert parent < n  # ancestors come first
    # Each node's subtree is the run right after it: a descendant's ancestors include it.
    for n in range(len(trie)):
        below = [m for m in range(len(trie)) if n in trie.ancestors(m)]
        assert below == list(range(n + 1, n + 1 + len(below)))
    chains = trie.chains()
    assert [c.start for c in chains][0] == 0 and chains[-1].end == len(trie)
    assert all(a.end == b.start for a, b in zip(chains, chains[1:]))
    for c in chains:
        assert all(trie.parents[n] == n - 1 for n in range(c.start + 1, c.end))
        assert list(c.ancestors) == trie.ancestors(c.start)
    assert len(chains) <= len(seqs)
    assert len(trie) == 20 + 3 * 5 + sum(len(s) - 25 for s in seqs) - _repeats(seqs)


def _repeats(seqs):
    """Response tokens shared with an earlier sequence of the same group (by brute force)."""
    seen, shared = set(), 0
    for s in seqs:
        for d in range(25, len(s)):
            shared += tuple(s[: d + 1]) in seen
        seen.update(tuple(s[: d + 1]) for d in range(len(s)))
    return shared


def test_pack_by_prefix_keeps_each_pack_within_its_node_budget():
    rng = random.Random(1)
    seqs = [[g] * 30 + [rng.randrange(9) for _ in range(rng.randrange(1, 20))] for g in range(4) for _ in range(8)]
    for budget in (10, 60, 120, 10_000):
        packs = pack_by_prefix(seqs, budget)
        assert sorted(i for p in packs for i in p) == list(range(len(seqs)))
        for p in packs:
            assert len(build_trie([seqs[i] for i in p])) <= budget or len(p) == 1
    assert len(pack_by_prefix(seqs, 10_000)) == 1
    assert shared_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    with pytest.raises(ValueError, match="empty"):
        build_trie([[1], []])


# ------------------------------------------------------------------ learner exactness


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny-trie"))


def _turns(rng, n_turns, shared_first=None):
    """A response: sampled turns (mask 1) with observations between (mask 0)."""
    ids, mask = [], []
    for t in range(n_turns):
        turn = shared_first if (t == 0 and shared_first) else [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 7))]
        ids += turn
        mask += [1] * len(turn)
        if t < n_turns - 1:
            obs = [rng.randrange(VOCAB) for _ in range(3)]
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


def rl_groups(seed=0, groups=3, group_size=4):
    """Groups sharing a system prompt, each its own task prompt; in each group two samples
    share their first turn, one sample repeats another whole and one is another's head."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(24)]
    samples = []
    for g in range(groups):
        prompt = system + [rng.randrange(VOCAB) for _ in range(8 + g)]
        first = [rng.randrange(VOCAB) for _ in range(5)]
        traces = [_turns(rng, 3, first if k < 2 else None) for k in range(group_size)]
        traces[-1] = traces[0]  # an identical trajectory
        ids, mask = traces[1]
        traces.append((ids[:7], mask[:7]))  # the head of another trajectory
        for k, (ids, mask) in enumerate(traces):
            adv = [1.0, -1.0, 0.5, -0.5, 2.0][k % 5]
            samples.append(TrainSample(TokenTrace(list(prompt), list(ids), [0.0] * len(ids), list(mask)), adv))
    return samples


def sft_batch(seed=1, n=5):
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(30)]
    out = []
    for _ in range(n):
        ids, mask = _turns(rng, 2)
        out.append(TrainSample(TokenTrace(system + [rng.randrange(VOCAB) for _ in range(6)], ids, [0.0] * len(ids), mask), 1.0))
    return out


def per_sample(model_dir, samples, temperature, loss_fn):
    """Today's computation, independent of the trie code: one plain HF forward per sample,
    fp32 head, the loss over the global loss-token count; returns (loss, grads by name)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa").train()
    denominator = float(sum(s.num_loss_tokens for s in samples))
    total = 0.0
    for s in samples:
        t = s.trace
        ids = torch.tensor([t.prompt_ids + t.ids])
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        pos = torch.tensor([len(t.prompt_ids) + k - 1 for k, m in enumerate(t.mask) if m])
        targets = torch.tensor([tok for tok, m in zip(t.ids, t.mask) if m])
        logits = hidden[pos].float() @ model.lm_head.weight.float().T / temperature
        new = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        n = len(targets)
        old = torch.tensor([lp for lp, m in zip(t.logprobs, t.mask) if m])
        loss, _ = loss_fn(new, old, torch.full((n,), s.advantage), torch.ones(n), denominator)
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad for k, p in model.named_parameters()}


def assert_same_gradients(learner, ref_grads):
    for name, p in learner.model.named_parameters():
        ref = ref_grads[name]
        err = float((p.grad - ref).norm() / ref.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"


def test_trie_learner_equals_per_sample_dppo_on_rl_groups(model_dir):
    temperature = 0.1  # peaked distributions, so the DPPO mask can block tokens
    samples = rl_groups()
    learner = Learner(model_dir, LearnerConfig(temperature=temperature, pack_length=4096))
    assert learner.packing
    # Sampler logprobs away from the trainer's: r != 1 everywhere, blocked tokens on the
    # negative-advantage samples (mu = pi + 0.3, so TV > delta and r < 1).
    for s, lps in zip(samples, learner.logprobs(samples)):
        s.trace.logprobs = [min(lp + 0.3, -1e-3) if m and s.advantage > 0 else
                            float(torch.tensor(lp).exp().add(0.3).clamp(max=0.999).log()) if m else 0.0
                            for lp, m in zip(lps, s.trace.mask)]
    assert len(pack_samples(samples, 4096)) == 1
    stats = learner.backward(samples)
    cfg = LossConfig()

    def dppo(new, old, adv, mask, denominator):
        return policy_loss(new, old, adv, mask, cfg, denominator=denominator)

    ref_loss, ref_grads = per_sample(model_dir, samples, temperature, dppo)
    assert 0 < stats.summarize()["debug/dppo_mask_frac_kept"] < 1
    assert stats.loss_sum / stats.tokens == pytest.approx(ref_loss, rel=1e-5)
    assert_same_gradients(learner, ref_grads)
    pack = build_pack(samples, list(range(len(samples))))
    assert len(pack.trie) < sum(len(s) for s in samples) / 2


def test_trie_learner_equals_per_sample_cross_entropy_on_sft_batches(model_dir):
    samples = sft_batch()
    learner = Learner(model_dir, LearnerConfig(pack_length=4096))
    assert learner.packing
    stats = learner.backward(samples, loss_fn=sft_loss)

    def ce(new, old, adv, mask, denominator):
        return -(new * mask).sum() / denominator, None

    ref_loss, ref_grads = per_sample(model_dir, samples, 1.0, ce)
    assert stats.loss_sum / stats.tokens == pytest.approx(ref_loss, rel=1e-5)
    assert_same_gradients(learner, ref_grads)
    assert len(build_pack(samples, list(range(len(samples)))).trie) < sum(len(s) for s in samples) * 0.6


def test_train_step_reports_tokens_computed_beside_tokens(model_dir):
    samples = rl_groups(seed=2)
    learner = Learner(model_dir, LearnerConfig(pack_length=4096, lr=1e-3))
    for s, lps in zip(samples, learner.logprobs(samples)):
        s.trace.logprobs = [lp if m else 0.0 for lp, m in zip(lps, s.trace.mask)]
    metrics = learner.train_step(samples)
    assert metrics["learner/tokens"] == sum(len(s) for s in samples)
    assert metrics["learner/tokens_computed"] == len(build_trie([s.tokens for s in samples]))
    assert metrics["learner/tokens_computed"] < metrics["learner/tokens"] / 2
    # One row per sample (a budget below any sample) computes every token of every sample.
    alone = Learner(model_dir, LearnerConfig(pack_length=2, lr=1e-3)).train_step(samples)
    assert alone["learner/tokens_computed"] == alone["learner/tokens"]


def test_linear_attention_hybrid_falls_back_to_one_row_per_sample(tmp_path):
    """A Gated-DeltaNet hybrid's linear layers run along the row and cannot attend over a
    trie: the learner finds out at start and computes one row per sample, still exact."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, max_position_embeddings=512, layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    samples = sft_batch(n=3)
    learner = Learner(tmp_path, LearnerConfig(pack_length=4096))
    assert not learner.packing
    stats = learner.backward(samples, loss_fn=sft_loss)

    def ce(new, old, adv, mask, denominator):
        return -(new * mask).sum() / denominator, None

    ref_loss, ref_grads = per_sample(tmp_path, samples, 1.0, ce)
    assert stats.loss_sum / stats.tokens == pytest.approx(ref_loss, rel=1e-5)
    assert_same_gradients(learner, ref_grads)
