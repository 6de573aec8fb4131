"""Learner rank groups on real torch.distributed gloo (separate processes, FSDP2) and the
weight process group broadcasting to receivers."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from tmax.training.algo.dppo import LossConfig, policy_loss
from tmax.training.learner import parallel as D
from tmax.training.net import free_port
from tmax.training.weights import protocol as P
from tmax.training.weights.group import WeightGroup, WeightSender, receive


def tiny_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float().eval()


def make_batch(seed: int = 1):
    """Four sequences with different lengths and loss masks (prompt + tool tokens masked)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n, n_loss in [(9, 3), (14, 9), (20, 12), (11, 6)]:
        ids = torch.randint(0, 300, (n,), generator=g)
        mask = torch.zeros(n)
        mask[n - n_loss :] = 1
        mask[n - n_loss + 1] = 0  # a tool token inside the response
        seqs.append({"ids": ids, "mask": mask, "adv": float(torch.randn((), generator=g))})
    return seqs


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log pi(ids[:, t] | ids[:, <t]) for t >= 1 on a right-padded [B, T] batch, fp32
    head; column 0 gets 0. Right padding never changes the logits of earlier tokens."""
    logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1)


def pad(seqs):
    T = max(len(s["ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask, adv = torch.zeros(len(seqs), T), torch.zeros(len(seqs), T)
    for i, s in enumerate(seqs):
        n = len(s["ids"])
        ids[i, :n], mask[i, :n], adv[i, :n] = s["ids"], s["mask"], s["adv"]
    return ids, mask, adv


def local_loss(model, seqs, denominator, old_shift: float = 0.15):
    """One forward over this rank's sequences: FSDP2 ranks must run the same number of
    forward passes (each one is a collective), whatever their token counts."""
    ids, mask, adv = pad(seqs)
    new = token_logprobs(model, ids)
    # Sampler log-probs off by a fixed pattern so ratios differ from 1 and some tokens
    # are masked by the trust region.
    old = (new.detach() + old_shift * torch.cos(torch.arange(ids.shape[1]).float())).clamp(max=0)
    loss, _ = policy_loss(new, old, adv, mask, LossConfig(delta=0.1), denominator=denominator)
    return loss


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    ctx = D.init_learner_group(rank, world, "127.0.0.1", port, backend="gloo", timeout_s=120)
    model = D.shard_model(tiny_model(), ctx)
    seqs = make_batch()
    mine = seqs[:1] if rank == 0 else seqs[1:]  # very unequal token counts per rank
    local_tokens = sum(float(s["mask"].sum()) for s in mine)
    n = D.data_parallel(ctx).all_reduce(torch.tensor(local_tokens, dtype=torch.float64))
    loss = local_loss(model, mine, n) * ctx.grad_scale
    loss.backward()
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for k, p in model.named_parameters()}
    weights = D.full_weights(model, ctx)
    if ctx.is_main:
        torch.save({"grads": grads, "n": float(n), "weights": weights}, out)
    D.destroy_learner_group()


def test_two_gloo_ranks_match_one_rank(tmp_path):
    model = tiny_model()
    seqs = make_batch()
    n_total = sum(float(s["mask"].sum()) for s in seqs)
    local_loss(model, seqs, n_total).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}

    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank_main, args=(2, free_port(), out), nprocs=2, join=True)
    got = torch.load(out)
    assert got["n"] == n_total
    assert set(got["grads"]) == set(ref)
    for k in ref:
        torch.testing.assert_close(got["grads"][k], ref[k], rtol=1e-4, atol=1e-6, msg=k)
    # A denominator that is only local would double the rank-1 share: make sure it matters.
    assert any(r.abs().sum() > 0 for r in ref.values())
    # Gathered weights are the full (unsharded) parameters.
    for k, p in model.named_parameters():
        torch.testing.assert_close(got["weights"][k], p.detach())


def test_local_denominator_would_be_wrong():
    """Control for the test above: per-rank token means do not give the global mean."""
    model = tiny_model()
    seqs = make_batch()
    n_total = sum(float(s["mask"].sum()) for s in seqs)
    g_ref = torch.autograd.grad(local_loss(model, seqs, n_total), list(model.parameters()))
    a, b = seqs[:1], seqs[1:]
    wrong = local_loss(model, a, sum(float(s["mask"].sum()) for s in a)) + local_loss(
        model, b, sum(float(s["mask"].sum()) for s in b)
    )
    g_wrong = torch.autograd.grad(wrong / 2, list(model.parameters()))
    assert not all(torch.allclose(x, y, rtol=1e-3) for x, y in zip(g_ref, g_wrong))


def _group_main(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    group = WeightGroup("127.0.0.1", port, rank, world, backend="gloo", timeout_s=60)
    if rank == 0:
        model = tiny_model(seed=7)
        sender = WeightSender(group, bucket_mb=0.05)
        upd = sender.prepare(D.full_weights(model, D.RankContext(0, 1, "none", torch.device("cpu"))), version=5)
        torch.save(upd, out + ".update")
        # Receivers read the update from disk in this test (Ray carries it in tmax).
        open(out + ".ready", "w").close()
        sender.send()
    else:
        import time

        while not os.path.exists(out + ".ready"):
            time.sleep(0.05)
        upd = torch.load(out + ".update", weights_only=False)
        model = tiny_model(seed=100 + rank)
        n = P.load_into(model, receive(group, upd))
        torch.save({"n": n, "state": model.state_dict(), "version": upd.version}, f"{out}.{rank}")
    group.close()


def test_weight_group_broadcast_gloo(tmp_path):
    out = str(tmp_path / "w")
    mp.spawn(_group_main, args=(3, free_port(), out), nprocs=3, join=True)
    src = tiny_model(seed=7).state_dict()
    for r in (1, 2):
        got = torch.load(f"{out}.{r}")
        assert got["version"] == 5 and got["n"] == len(list(tiny_model().parameters()))
        for k, v in src.items():
            assert torch.equal(got["state"][k], v), k
