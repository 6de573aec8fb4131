"""Learner on a real tiny Qwen3 model (tests/tiny_learner.py): alignment, zero-mismatch
sanity, packing, one step. The learner over several real ranks (gloo, FSDP2) is in
tests/integration/test_learner_ranks.py."""

import math

import pytest
import torch

from tiny_learner import VOCAB, grads, make_model_dir, sampled_batch
from tmax.agents.policy import TokenTrace
from tmax.training.learner.learner import Learner, LearnerConfig
from tmax.training.learner.packing import TrainSample, build_pack, pack_samples, shard

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def hidden_grads(learner, samples):
    """Gradient of the loss w.r.t. the backbone's last hidden state of each packed row."""
    captured = []

    def hook(module, args, output):
        output.last_hidden_state.retain_grad()
        captured.append(output.last_hidden_state)

    handle = learner.backbone.register_forward_hook(hook)
    try:
        learner.backward(samples)
    finally:
        handle.remove()
    return [h.grad[0].norm(dim=-1) for h in captured]



# ------------------------------------------------------------------ alignment


def test_pack_targets_are_exactly_the_sampled_tokens():
    s = TrainSample(TokenTrace([7, 8], [10, 11, 12, 13, 14], [-1.0, -2.0, 0.0, 0.0, -3.0], [1, 1, 0, 0, 1]), 2.0)
    t = TrainSample(TokenTrace([9], [20, 21], [-0.5, 0.0], [1, 0]), -1.0)
    pack = build_pack([s, t], [0, 1])
    assert pack.input_ids[0].tolist() == [7, 8, 10, 11, 12, 13, 14, 9, 20, 21]
    assert pack.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert pack.targets.tolist() == [10, 11, 14, 20]
    # Shift by one: each target sits right after the position that predicts it.
    assert pack.input_ids[0, pack.pred_pos + 1].tolist() == pack.targets.tolist()
    assert pack.pred_pos.tolist() == [1, 2, 5, 7]
    assert pack.old_logprobs.tolist() == [-1.0, -2.0, -3.0, -0.5]
    assert pack.advantages.tolist() == [2.0, 2.0, 2.0, -1.0]


def test_zero_mismatch_fp32_and_only_sampled_positions_get_gradient(model_dir):
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, temperature=0.7))
    assert learner.packing
    samples = sampled_batch(model_dir, temperature=0.7)
    # Trainer recomputation vs sampler-recorded logprobs: same weights, fp32 both sides.
    trainer = learner.logprobs(samples)
    diffs = [abs(a - b) for s, lp in zip(samples, trainer) for a, b, m in zip(s.trace.logprobs, lp, s.trace.mask) if m]
    assert max(diffs) < 1e-5
    metrics = learner.train_step(samples)
    assert metrics["debug/dppo_mask_frac_kept"] == 1.0
    assert metrics["debug/vllm_vs_local_logprob_diff_max"] < 1e-5
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["learner/loss_tokens"] == sum(s.num_loss_tokens for s in samples)


def test_observation_tokens_get_no_gradient(model_dir):
    learner = Learner(model_dir, LearnerConfig(temperature=1.0))
    samples = sampled_batch(model_dir, temperature=1.0)
    rows = pack_samples(samples, learner.cfg.pack_length)
    assert len(rows) == 1
    norms = hidden_grads(learner, samples)[0]
    pack = build_pack(samples, rows[0])
    expected = set(pack.pred_pos.tolist())
    nonzero = set(torch.nonzero(norms > 0).flatten().tolist())
    # Exactly the positions that predict sampled tokens: not the prompt, not the positions
    # predicting observation tokens, not the last position of each sample.
    assert nonzero == expected
    assert len(expected) == sum(s.num_loss_tokens for s in samples)
    # Whatever sits in the logprob slots of observation tokens is irrelevant.
    g0 = grads(learner)
    for s in samples:
        s.trace.logprobs = [lp if m else -50.0 for lp, m in zip(s.trace.logprobs, s.trace.mask)]
    learner.backward(samples)
    for a, b in zip(g0, grads(learner)):
        assert torch.equal(a, b)


def test_temperature_scaling_matches_sampler(model_dir):
    samples = sampled_batch(model_dir, temperature=0.5, advantages=(1.0,))
    right = Learner(model_dir, LearnerConfig(temperature=0.5)).logprobs(samples)[0]
    wrong = Learner(model_dir, LearnerConfig(temperature=1.0)).logprobs(samples)[0]
    sampled = [(lp, r, w) for lp, r, w, m in zip(samples[0].trace.logprobs, right, wrong, samples[0].trace.mask) if m]
    assert max(abs(lp - r) for lp, r, _ in sampled) < 1e-5
    assert max(abs(lp - w) for lp, _, w in sampled) > 1e-2


def test_perturbed_sampler_masks_only_tokens_moving_away(model_dir):
    temperature = 0.1  # peaked distributions, so probabilities can move by more than delta
    learner = Learner(model_dir, LearnerConfig(temperature=temperature))
    samples = sampled_batch(model_dir, temperature=temperature, advantages=(1.0, -1.0, 1.0, -1.0), seed=3)
    trainer = learner.logprobs(samples)
    expected_masked, both_directions = [], set()
    k = 0
    for s, lp in zip(samples, trainer):
        masked = []
        for j, m in enumerate(s.trace.mask):
            if not m:
                continue
            pi = math.exp(lp[j])
            mu = [pi / 2, min(pi + 0.3, 0.999), pi][k % 3]  # r = 2 | r < 1 | r = 1
            k += 1
            s.trace.logprobs[j] = math.log(mu)
            away = (s.advantage > 0 and pi > mu) or (s.advantage < 0 and pi < mu)
            blocked = abs(pi - mu) > 0.1 and away
            if blocked:
                both_directions.add(s.advantage > 0)
            masked.append(blocked)
        expected_masked.append(masked)
    assert both_directions == {True, False}  # both the r > 1 and the r < 1 side occur

    norms = hidden_grads(learner, samples)[0]
    pack = build_pack(samples, pack_samples(samples, learner.cfg.pack_length)[0])
    by_sample = {i: (first, count) for i, first, count in pack.spans}
    for i, masked in enumerate(expected_masked):
        first, count = by_sample[i]
        got = norms[pack.pred_pos[first : first + count]]
        for blocked, g in zip(masked, got):
            assert (g == 0) == blocked
    flat = [b for ms in expected_masked for b in ms]
    metrics = learner.train_step(samples)
    assert 0 < metrics["debug/dppo_mask_frac_kept"] < 1
    assert metrics["debug/dppo_mask_frac_kept"] == pytest.approx(1 - sum(flat) / len(flat))
    assert metrics["debug/vllm_vs_local_logprob_diff_max"] > 0.1


# ------------------------------------------------------------------ packing and optimisation


def test_packing_matches_one_sample_per_row(model_dir):
    samples = sampled_batch(model_dir, advantages=(1.0, -1.0, 0.5, -0.25, 2.0))
    for s in samples:  # some ratio != 1 so the ratio weighting is exercised too
        s.trace.logprobs = [lp - 0.05 * (i % 3) if m else 0.0 for i, (lp, m) in enumerate(zip(s.trace.logprobs, s.trace.mask))]
    packed = Learner(model_dir, LearnerConfig(pack_length=4096))
    alone = Learner(model_dir, LearnerConfig(pack_length=2))  # every sample its own row
    assert len(pack_samples(samples, 4096)) == 1 and len(pack_samples(samples, 2)) == len(samples)
    a, b = packed.logprobs(samples), alone.logprobs(samples)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, abs=1e-5)
    packed.backward(samples)
    alone.backward(samples)
    for ga, gb in zip(grads(packed), grads(alone)):
        assert torch.allclose(ga, gb, atol=1e-6, rtol=1e-4)


def test_chunked_head_and_gradient_checkpointing_give_same_gradients(model_dir):
    samples = sampled_batch(model_dir)
    ref = Learner(model_dir, LearnerConfig())
    other = Learner(model_dir, LearnerConfig(head_chunk=3, gradient_checkpointing=True))
    s_ref, s_other = ref.backward(samples), other.backward(samples)
    assert s_ref.summarize() == pytest.approx(s_other.summarize(), abs=1e-6)
    for ga, gb in zip(grads(ref), grads(other)):
        assert torch.allclose(ga, gb, atol=1e-6, rtol=1e-4)


def test_one_train_step_changes_weights_and_lowers_the_loss(model_dir):
    samples = sampled_batch(model_dir)
    learner = Learner(model_dir, LearnerConfig(lr=1e-3))
    before = {k: v.clone() for k, v in learner.named_weights().items()}
    loss0 = learner.backward(samples).summarize()["loss/policy_avg"]
    metrics = learner.train_step(samples)
    assert metrics["loss/policy_avg"] == pytest.approx(loss0, abs=1e-6)
    assert learner.step == 1
    # Exactly one optimizer step.
    assert all(int(learner.optimizer.state[p]["step"]) == 1 for p in learner.params)
    after = learner.named_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    loss1 = learner.backward(samples).summarize()["loss/policy_avg"]
    assert loss1 < loss0 - 1e-3
    assert metrics["optim/grad_norm"] > 0 and metrics["lr"] == 1e-3


def test_grad_clip_bounds_the_update_gradient(model_dir):
    samples = sampled_batch(model_dir, advantages=(5.0, -5.0))
    learner = Learner(model_dir, LearnerConfig(max_grad_norm=1e-3, lr=0.0))
    metrics = learner.train_step(samples)
    assert metrics["optim/grad_norm"] > 1e-3  # reported norm is the pre-clip one
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in learner.params))
    assert float(total) == pytest.approx(1e-3, rel=1e-3)


def test_named_weights_are_hf_names_without_the_tied_head(model_dir):
    from transformers import AutoModelForCausalLM

    learner = Learner(model_dir, LearnerConfig(lr=1e-2))
    learner.train_step(sampled_batch(model_dir, advantages=(1.0, -1.0)))
    weights = learner.named_weights()
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    fresh = AutoModelForCausalLM.from_pretrained(str(model_dir))
    missing, unexpected = fresh.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert torch.allclose(fresh(input_ids=ids).logits, learner.model(input_ids=ids).logits, atol=1e-5)


def test_bf16_body_keeps_fp32_head_and_logprobs(model_dir):
    learner = Learner(model_dir, LearnerConfig(dtype="bfloat16"))
    assert learner.model.dtype == torch.bfloat16
    samples = sampled_batch(model_dir, advantages=(1.0,))
    pack = build_pack(samples, [0])
    with torch.no_grad():
        lp = learner.pack_logprobs(pack)
        hidden = learner._hidden(pack.input_ids, pack.position_ids)[0][pack.pred_pos]
        w = learner.head.weight
        fp32 = torch.log_softmax(hidden.float() @ w.float().T, -1).gather(-1, pack.targets[:, None])[:, 0]
        bf16 = torch.log_softmax((hidden @ w.T).float(), -1).gather(-1, pack.targets[:, None])[:, 0]
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, fp32, atol=1e-6)
    assert not torch.allclose(lp, bf16, atol=1e-6)


def test_bad_samples_are_rejected_with_specific_errors(model_dir):
    learner = Learner(model_dir, LearnerConfig())
    ok = dict(prompt_ids=[1, 2], ids=[3, 4], logprobs=[-1.0, 0.0], mask=[1, 0], advantage=1.0)

    def sample(advantage, **trace):
        return TrainSample(TokenTrace(**trace), advantage)

    cases = [
        (dict(ok, prompt_ids=[]), "empty prompt_ids"),
        (dict(ok, logprobs=[-1.0]), "differ in length"),
        (dict(ok, mask=[1, 2]), "mask values"),
        (dict(ok, ids=[3, VOCAB]), "outside the vocabulary"),
        (dict(ok, logprobs=[float("nan"), 0.0]), "sampler logprob nan"),
        (dict(ok, logprobs=[0.5, 0.0]), "sampler logprob 0.5"),
        (dict(ok, advantage=float("inf")), "advantage"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            learner.train_step([sample(**kwargs)])
    with pytest.raises(ValueError, match="no sampled"):
        learner.train_step([sample(**dict(ok, mask=[0, 0]))])
    with pytest.raises(FileNotFoundError, match="config.json"):
        Learner(model_dir / "nope")


# ------------------------------------------------------------------ data parallel (gloo)


def test_shard_balances_tokens_and_covers_every_sample():
    samples = [TrainSample(TokenTrace([1] * n, [2], [-1.0], [1]), 0.0) for n in (9, 1, 5, 5, 3, 7, 2)]
    parts = [shard(samples, r, 3) for r in range(3)]
    assert sorted(id(s) for p in parts for s in p) == sorted(id(s) for s in samples)
    loads = [sum(len(s) for s in p) for p in parts]
    assert max(loads) - min(loads) <= 3


def test_sft_loss_through_the_learner_is_the_token_mean_cross_entropy(model_dir):
    """SFT's PackLoss on the same packs: the step's loss is the cross-entropy of the mask-1
    tokens, and the step raises their likelihood."""
    from tmax.training.learner.sft import sft_loss

    samples = sampled_batch(model_dir, advantages=(1.0, 1.0, 1.0))
    learner = Learner(model_dir, LearnerConfig(lr=1e-3))

    def sampled_logprobs():
        return [lp for s, lps in zip(samples, learner.logprobs(samples)) for lp, m in zip(lps, s.trace.mask) if m]

    before = sampled_logprobs()
    metrics = learner.train_step(samples, loss_fn=sft_loss)
    assert metrics["loss/policy_avg"] == pytest.approx(-sum(before) / len(before), rel=1e-5)
    assert metrics["learner/loss_tokens"] == len(before)
    assert sum(sampled_logprobs()) > sum(before)


def test_autocast_body_keeps_fp32_master_weights_and_fp32_head(model_dir):
    samples = sampled_batch(model_dir, advantages=(1.0, -1.0))
    learner = Learner(model_dir, LearnerConfig(autocast="bfloat16", lr=1e-3))
    assert all(p.dtype == torch.float32 for p in learner.params)
    pack = build_pack(samples, [0])
    with torch.no_grad():
        hidden = learner._hidden(pack.input_ids, pack.position_ids)[0][pack.pred_pos]
        lp = learner.pack_logprobs(pack)
    assert lp.dtype == torch.float32
    fp32 = torch.log_softmax(hidden.float() @ learner.head.weight.T, -1).gather(-1, pack.targets[:, None])[:, 0]
    assert torch.allclose(lp, fp32, atol=1e-6)
    # bf16 compute against fp32 sampler logprobs: a small, visible mismatch.
    metrics = learner.train_step(samples)
    assert 1e-5 < metrics["debug/vllm_vs_local_logprob_diff_max"] < 0.5
    assert all(p.dtype == torch.float32 for p in learner.params)


def test_train_sample_holds_the_token_trace():
    trace = TokenTrace(prompt_ids=[1, 2])
    trace.extend([5, 6], [-0.5, -0.25], trainable=True)
    trace.extend([7], None, trainable=False)
    s = TrainSample(trace, 0.75)
    assert s.trace is trace and len(s) == 5 and s.num_loss_tokens == 2
    assert build_pack([s], [0]).targets.tolist() == [5, 6]


def test_strategy_is_checked():
    with pytest.raises(ValueError, match="strategy must be one of fsdp, replicate"):
        LearnerConfig(strategy="ddp2")
    from tmax.training.learner.parallel import DataParallel, data_parallel
    from tmax.training.learner.parallel import RankContext

    assert type(data_parallel(RankContext(0, 1, "none", torch.device("cpu")), "fsdp")) is DataParallel
