"""DPPO mask and divergences (truth table, binary TV / KL values), the loss (its gradient
equals that of -A M sg(r) log pi) and the GRPO baseline."""

import math

import pytest
import torch

from tmax.training.algo.dppo import LossConfig, LossStats, binary_kl, binary_tv, dppo_mask, policy_loss


def lp(*probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def kl_ref(mu, pi):
    return mu * math.log(mu / pi) + (1 - mu) * math.log((1 - mu) / (1 - pi))


# ------------------------------------------------------------------ divergences


@pytest.mark.parametrize("mu,pi,tv", [(0.1, 0.2, 0.1), (0.5, 0.5, 0.0), (0.9, 0.3, 0.6)])
def test_binary_tv_values(mu, pi, tv):
    assert binary_tv(lp(pi), lp(mu)).item() == pytest.approx(tv, abs=1e-12)


@pytest.mark.parametrize("mu,pi", [(0.1, 0.2), (0.9, 0.3), (0.3, 0.9), (0.01, 0.5)])
def test_binary_kl_values_and_direction(mu, pi):
    # KL(mu || pi), not KL(pi || mu).
    assert binary_kl(lp(pi), lp(mu)).item() == pytest.approx(kl_ref(mu, pi), rel=1e-9)
    assert kl_ref(mu, pi) != pytest.approx(kl_ref(pi, mu), rel=1e-3)


def test_binary_kl_zero_when_equal_and_finite_at_extremes():
    assert binary_kl(lp(0.5), lp(0.5)).item() == pytest.approx(0.0, abs=1e-12)
    # log-probs below -30 / at 0 / slightly above 0 (sampler rounding) stay finite.
    new = torch.tensor([-1000.0, 0.0, 1e-6, -1e-12], dtype=torch.float64)
    old = torch.tensor([0.0, -1000.0, -0.5, 0.0], dtype=torch.float64)
    assert torch.isfinite(binary_kl(new, old)).all()
    assert torch.isfinite(binary_tv(new, old)).all()
    # Clamp to [-30, 0] before exp: a log-prob of +1 counts as probability 1.
    assert binary_tv(torch.tensor([1.0]), torch.tensor([0.0])).item() == 0.0


# ------------------------------------------------------------------ mask truth table


def test_mask_truth_table_reference_case():
    # mu = 0.1 -> pi = 0.5 (r = 5 > 1, TV 0.4 > 0.1), with A = +1, -1, 0, and a padding slot.
    new = lp(0.5, 0.5, 0.5, 0.5)
    old = lp(0.1, 0.1, 0.1, 0.1)
    adv = torch.tensor([1.0, -1.0, 0.0, 1.0], dtype=torch.float64)
    valid = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    for div in ("tv", "kl"):
        m = dppo_mask(new, old, adv, valid, delta=0.1, divergence=div)
        assert m.tolist() == [0.0, 1.0, 1.0, 0.0]
        # delta above the divergence keeps every real token; padding stays 0.
        m = dppo_mask(new, old, adv, valid, delta=0.5, divergence=div)
        assert m.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_mask_mirror_case_negative_side():
    # mu = 0.5 -> pi = 0.1 (r < 1): only the negative-advantage token is pushed further away.
    new, old = lp(0.1, 0.1, 0.1), lp(0.5, 0.5, 0.5)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    m = dppo_mask(new, old, adv, torch.ones(3, dtype=torch.float64), delta=0.1)
    assert m.tolist() == [1.0, 0.0, 1.0]


def test_mask_strict_inequality_on_divergence():
    new, old = lp(0.5), lp(0.1)
    adv = torch.tensor([1.0], dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    d = binary_tv(new, old).item()
    assert dppo_mask(new, old, adv, one, delta=d).item() == 1.0  # D == delta: kept
    assert dppo_mask(new, old, adv, one, delta=math.nextafter(d, 0)).item() == 0.0


def test_mask_has_no_grad_and_ignores_nan_padding():
    new = lp(0.5, 0.5).float().requires_grad_()
    old = torch.tensor([math.log(0.1), float("nan")])
    m = dppo_mask(new, old, torch.tensor([-1.0, 1.0]), torch.tensor([1.0, 0.0]))
    assert not m.requires_grad and m.grad_fn is None
    assert m.tolist() == [1.0, 0.0]


def test_tv_vs_ratio_clip_reference_examples():
    # mu = 1e-4 -> pi = 1e-2: r = 100 but only 0.0099 of mass moved: DPPO keeps, GRPO clips.
    # mu = 0.99 -> pi = 0.80 with A < 0: r = 0.81 inside the clip range but 0.19 moved: DPPO blocks.
    new, old = lp(1e-2, 0.80), lp(1e-4, 0.99)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    m = dppo_mask(new, old, adv, torch.ones(2, dtype=torch.float64), delta=0.1)
    assert m.tolist() == [1.0, 0.0]
    _, st = policy_loss(new, old, adv, torch.ones(2, dtype=torch.float64), LossConfig(loss_fn="grpo"))
    assert st.clipped == 1.0 and st.kept == 1.0


# ------------------------------------------------------------------ loss


def test_loss_value_no_cap_and_token_mean():
    # r = 100 is not capped: the kept token contributes -A * r.
    new, old = lp(1e-2, 0.3, 0.3), lp(1e-4, 0.3, 0.3)
    adv = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    valid = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    loss, st = policy_loss(new, old, adv, valid)
    assert loss.item() == pytest.approx((-1.0 * 100 - 2.0 * 1.0) / 2, rel=1e-9)
    assert st.tokens == 2 and st.kept == 2
    # An explicit (global) denominator replaces the local token count.
    loss, _ = policy_loss(new, old, adv, valid, denominator=10.0)
    assert loss.item() == pytest.approx((-100 - 2.0) / 10, rel=1e-9)


def test_masked_tokens_get_exactly_zero_gradient_and_ratio_carries_gradient():
    new = lp(0.5, 0.5, 0.2).requires_grad_()
    old = lp(0.1, 0.1, 0.2)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss, st = policy_loss(new, old, adv, torch.ones(3, dtype=torch.float64))
    loss.backward()
    # d(-A r M / N)/d log pi = -A r M / N
    assert new.grad.tolist() == pytest.approx([0.0, 5.0 / 3, -1.0 / 3], rel=1e-9)
    assert st.kept == 2


def test_nan_and_sentinels_outside_loss_tokens_do_not_leak():
    new = torch.tensor([-1.0, float("nan"), -2.0], requires_grad=True)
    old = torch.tensor([-1.2, float("nan"), 1.0])
    adv = torch.tensor([1.0, float("nan"), 3.0])
    valid = torch.tensor([1.0, 0.0, 0.0])
    loss, st = policy_loss(new, old, adv, valid)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    assert new.grad[1] == 0 and new.grad[2] == 0
    assert st.tokens == 1


def test_global_denominator_makes_split_gradients_sum_to_whole():
    torch.manual_seed(0)
    n = 40
    new = (torch.rand(n, dtype=torch.float64) * -3).requires_grad_()
    old = new.detach() + torch.randn(n, dtype=torch.float64) * 0.5
    old = old.clamp(max=0)
    adv = torch.randn(n, dtype=torch.float64)
    valid = (torch.rand(n) > 0.3).double()
    whole, _ = policy_loss(new, old, adv, valid)
    (g_whole,) = torch.autograd.grad(whole, new)
    total = valid.sum()
    parts = [policy_loss(new[s], old[s], adv[s], valid[s], denominator=total)[0] for s in (slice(0, 13), slice(13, n))]
    (g_parts,) = torch.autograd.grad(sum(parts), new)
    assert torch.allclose(g_whole, g_parts, atol=1e-12)


def test_grpo_clipping_gradient_and_clipfrac():
    # r = 1.5 (A > 0, clipped at 1.272), r = 0.5 (A < 0, clipped at 0.8), r = 0.5 with A > 0 (not clipped).
    new = lp(0.6, 0.2, 0.2).requires_grad_()
    old = lp(0.4, 0.4, 0.4)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    cfg = LossConfig(loss_fn="grpo")
    loss, st = policy_loss(new, old, adv, torch.ones(3, dtype=torch.float64), cfg)
    loss.backward()
    assert loss.item() == pytest.approx((-1.272 + 0.8 - 0.5) / 3, rel=1e-9)
    assert new.grad.tolist() == pytest.approx([0.0, 0.0, -0.5 / 3], rel=1e-9)
    m = st.summarize("grpo")
    assert m["policy/clipfrac_avg"] == pytest.approx(2 / 3)
    assert m["debug/dppo_mask_frac_kept"] == pytest.approx(1 / 3)


def test_metrics_names_and_values():
    new, old = lp(0.5, 0.4, 0.3), lp(0.1, 0.4, 0.3)
    adv = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    _, st = policy_loss(new, old, adv, torch.ones(3, dtype=torch.float64))
    m = st.summarize("dppo")
    diff = math.log(5)
    assert m["debug/dppo_mask_frac_kept"] == pytest.approx(2 / 3)
    assert m["debug/vllm_vs_local_logprob_diff_max"] == pytest.approx(diff)
    assert m["debug/vllm_vs_local_logprob_diff_mean"] == pytest.approx(diff / 3)
    assert m["debug/vllm_vs_local_logprob_diff_std"] == pytest.approx(math.sqrt(diff**2 / 3 - (diff / 3) ** 2))
    assert m["debug/vllm_local_reverse_kl"] == pytest.approx(0.1 * (math.log(0.1) - math.log(0.5)) / 3)
    assert m["val/ratio"] == pytest.approx((5 + 1 + 1) / 3)
    assert m["val/ratio_var"] == pytest.approx((25 + 1 + 1) / 3 - (7 / 3) ** 2)
    assert m["loss/policy_avg"] == pytest.approx(-1.0 / 3)  # masked token 0, A=0 token 0
    assert m["policy/clipfrac_avg"] == 0.0


def test_stats_combine_like_one_call():
    torch.manual_seed(1)
    new = torch.rand(30, dtype=torch.float64).log()
    old = torch.rand(30, dtype=torch.float64).log()
    adv = torch.randn(30, dtype=torch.float64)
    one = torch.ones(30, dtype=torch.float64)
    _, whole = policy_loss(new, old, adv, one)
    acc = LossStats()
    for s in (slice(0, 7), slice(7, 30)):
        acc.add(policy_loss(new[s], old[s], adv[s], one[s])[1])
    a, b = whole.summarize(), acc.summarize()
    assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    assert LossStats.from_tensor(acc.as_tensor()).summarize() == pytest.approx(b, rel=1e-12)


def test_config_validation():
    with pytest.raises(ValueError, match="loss_fn"):
        LossConfig(loss_fn="ppo2")
    with pytest.raises(ValueError, match="divergence"):
        LossConfig(divergence="topk")
    with pytest.raises(ValueError, match="delta"):
        LossConfig(delta=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.ones(3))


# ------------------------------------------------------------------ gradient equivalence on a real model


def test_gradient_equivalence_ratio_form_vs_logprob_form():
    """-A r M and -A M sg(r) log pi give the same parameter gradients on a real model."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        vocab_size=300, intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=256,
    )
    model = AutoModelForCausalLM.from_config(cfg).float()
    ids = torch.randint(0, 300, (2, 24))
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 23).contiguous()

    def token_logprobs():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    with torch.no_grad():
        base = token_logprobs()
    # Sampler log-probs: half the tokens far from pi (mu = 0.3 vs pi ~ 1/300), so both the
    # masked (A < 0, r < 1) and the kept branches occur.
    old = base.clone()
    old[:, ::2] = math.log(0.3)
    old[:, 1::2] += 0.05
    valid = torch.ones_like(old)
    valid[:, -3:] = 0

    loss_a, st = policy_loss(token_logprobs(), old, adv, valid)
    grads_a = torch.autograd.grad(loss_a, list(model.parameters()))
    assert 0 < st.kept < st.tokens

    new = token_logprobs()
    mask = dppo_mask(new, old, adv, valid)
    ratio = torch.exp(new - old).detach()
    loss_b = -(adv * mask * ratio * new).sum() / valid.sum()
    grads_b = torch.autograd.grad(loss_b, list(model.parameters()))
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-8)
    assert sum(g.abs().sum() for g in grads_a) > 0
