"""Learner on a real tiny Qwen3 model: alignment, zero-mismatch sanity, packing, one step.

The "sampler" here is a second copy of the weights loaded from disk, decoding token by
token with a KV cache and recording the post-temperature logprob of each sampled token,
with observation tokens fed in between turns (mask 0), as an inference engine does.
"""

import copy
import math
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from tmax.agents.policy import TokenTrace
from tmax.training.learner.learner import Learner, LearnerConfig
from tmax.training.learner.packing import TrainSample, build_pack, pack_samples, shard

VOCAB = 300


def make_model_dir(path, seed=0, tied=True):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        vocab_size=VOCAB, intermediate_size=128, tie_word_embeddings=tied, max_position_embeddings=512,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


@torch.no_grad()
def sample_episode(model, prompt, advantage, temperature, gen, turns=3, turn_len=5, obs_len=4):
    """Multi-turn decoding: sampled turns (mask 1, sampler logprob) and observations (mask 0)."""
    ids, lps, mask = [], [], []
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    for turn in range(turns):
        for _ in range(turn_len):
            logp = torch.log_softmax(logits.float() / temperature, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(tok), lps.append(float(logp[tok])), mask.append(1)
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        if turn < turns - 1:
            obs = torch.randint(0, VOCAB, (obs_len,), generator=gen).tolist()
            ids += obs
            lps += [0.0] * obs_len
            mask += [0] * obs_len
            out = model(input_ids=torch.tensor([obs]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return TrainSample(TokenTrace(list(prompt), ids, lps, mask), advantage)


def sampled_batch(model_dir, temperature=1.0, seed=0, advantages=(1.0, -1.0, 0.5, -0.5), **kw):
    from transformers import AutoModelForCausalLM

    sampler = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, adv in enumerate(advantages):
        prompt = torch.randint(0, VOCAB, (3 + 2 * n,), generator=gen).tolist()
        out.append(sample_episode(sampler, prompt, adv, temperature, gen, **kw))
    return out


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


def grads(learner):
    return [p.grad.detach().clone() for p in learner.params]


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


WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.packing import shard
    from tmax.training.learner.parallel import TorchDataParallel
    dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
    samples = torch.load(sys.argv[3], weights_only=False)
    learner = Learner(sys.argv[2], LearnerConfig(pack_length=40, strategy="replicate"), dp=TorchDataParallel())
    mine = shard(samples, learner.dp.rank, 2)
    stats = learner.backward(mine)
    if learner.dp.rank == 0:
        torch.save({"grads": [p.grad for p in learner.params], "metrics": stats.summarize()}, sys.argv[5])
    dist.destroy_process_group()
    """
)


def test_two_gloo_ranks_sum_to_the_single_process_gradient(model_dir, tmp_path):
    # Uneven samples so the ranks hold different token counts and pack counts.
    samples = sampled_batch(model_dir, advantages=(1.0, -1.0, 0.5, -0.5, 2.0), turn_len=6)
    first = samples[0].trace
    first.ids, first.logprobs, first.mask = first.ids[:6], first.logprobs[:6], first.mask[:6]
    for s in samples:
        s.trace.logprobs = [lp - 0.1 * (i % 2) if m else 0.0 for i, (lp, m) in enumerate(zip(s.trace.logprobs, s.trace.mask))]
    data, out, script = tmp_path / "samples.pt", tmp_path / "rank0.pt", tmp_path / "worker.py"
    torch.save(samples, data)
    script.write_text(WORKER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(model_dir), str(data), repo, str(out)], env=env)
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    result = torch.load(out, weights_only=False)

    single = Learner(model_dir, LearnerConfig(pack_length=40))
    stats = single.backward(samples)
    for ga, gb in zip(result["grads"], grads(single)):
        assert torch.allclose(ga, gb, atol=1e-6, rtol=1e-4)
    assert result["metrics"] == pytest.approx(stats.summarize(), abs=1e-6)


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


# ------------------------------------------------------------------ FSDP2 ranks (gloo)

FSDP_CFG = dict(lr=1e-3, pack_length=40, max_grad_norm=0.05, warmup_steps=2)


def _fsdp_rank(rank: int, port: int, model_dir: str, data: str, out: str) -> None:
    """One of two FSDP2 learner ranks: a step on a very unequal share of the batch, save,
    resume into a second learner on the same group, then one more step on both."""
    from tmax.training.learner import parallel as D
    from tmax.training.learner.parallel import FSDPDataParallel, data_parallel

    torch.set_num_threads(1)
    ctx = D.init_learner_group(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=180)
    cfg = LearnerConfig(**FSDP_CFG)
    learner = Learner(model_dir, cfg, data_parallel(ctx, "fsdp"))
    assert isinstance(learner.dp, FSDPDataParallel)
    sharded = all(hasattr(p, "full_tensor") for p in learner.params)
    samples = torch.load(data, weights_only=False)
    mine = samples[:1] if rank == 0 else samples[1:]
    metrics1 = learner.train_step(mine)
    grads1 = {n: p.grad.full_tensor() for n, p in learner.model.named_parameters()}
    local_state = {k: v.to_local().clone() for k, v in learner.optimizer.state[learner.params[0]].items()
                   if hasattr(v, "to_local")}
    weights1 = learner.named_weights()
    ckpt_dir = os.path.join(out, "ckpt")
    learner.save(ckpt_dir, extra={"note": "fsdp"})
    optim1 = learner.dp.optimizer_state(learner.optimizer)

    resumed = Learner.load(ckpt_dir, cfg, data_parallel(ctx, "fsdp"))
    step_resumed = resumed.step
    optim_resumed = resumed.dp.optimizer_state(resumed.optimizer)
    weights_resumed = resumed.named_weights()
    logprobs = learner.logprobs(mine)
    sharded_after_logprobs = all(hasattr(p, "full_tensor") for p in learner.model.parameters())
    metrics2 = learner.train_step(mine)
    metrics2_resumed = resumed.train_step(mine)
    weights2, weights2_resumed = learner.named_weights(), resumed.named_weights()
    result = dict(
        sharded=sharded, metrics1=metrics1, grads1=grads1, weights1=weights1, optim1=optim1,
        local_numel=sum(v.numel() for v in local_state.values()), full_numel=2 * learner.params[0].numel(),
        step_resumed=step_resumed, extra_resumed=resumed.extra, optim_resumed=optim_resumed,
        weights_resumed=weights_resumed, logprobs=logprobs,
        sharded_after_logprobs=sharded_after_logprobs, metrics2=metrics2,
        metrics2_resumed=metrics2_resumed, weights2=weights2, weights2_resumed=weights2_resumed,
    )
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    D.destroy_learner_group()


@pytest.fixture(scope="module", params=["tied", "untied"])
def fsdp_run(request, model_dir, tmp_path_factory):
    """Two FSDP2 ranks on gloo, and the single-process learner on the whole batch; with
    the LM head tied to the embeddings (one shared parameter in the root FSDP unit) and
    with a separate one."""
    import torch.multiprocessing as mp

    from tmax.training.net import free_port

    if request.param == "untied":
        model_dir = make_model_dir(tmp_path_factory.mktemp("untied"), tied=False)
    samples = sampled_batch(model_dir, advantages=(1.0, -1.0, 0.5, -0.5, 2.0), turn_len=6)
    for s in samples:  # ratios != 1 so the trust-region mask is exercised
        s.trace.logprobs = [lp - 0.1 * (i % 2) if m else 0.0 for i, (lp, m) in enumerate(zip(s.trace.logprobs, s.trace.mask))]
    out = tmp_path_factory.mktemp("fsdp")
    data = out / "samples.pt"
    torch.save(samples, data)
    mp.spawn(_fsdp_rank, args=(free_port(), str(model_dir), str(data), str(out)), nprocs=2, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]

    single = Learner(model_dir, LearnerConfig(**FSDP_CFG))
    metrics1 = single.train_step(samples)
    ref = dict(
        metrics1=metrics1, grads1={n: p.grad.clone() for n, p in single.model.named_parameters()},
        weights1={k: v.clone() for k, v in single.named_weights().items()},
        optim1=copy.deepcopy(single.optimizer.state_dict()), logprobs=single.logprobs(samples[:1]),
    )
    ref["metrics2"] = single.train_step(samples)
    ref["weights2"] = single.named_weights()
    return dict(samples=samples, ranks=ranks, ref=ref, ckpt=out / "ckpt", tied=request.param == "tied")


def _same_metrics(a: dict, b: dict) -> None:
    keys = [k for k in a if not k.startswith("time/") and "per_second" not in k]
    assert set(a) == set(b)
    assert {k: a[k] for k in keys} == pytest.approx({k: b[k] for k in keys}, rel=1e-5, abs=1e-6)


def test_fsdp_two_ranks_take_the_single_process_step(fsdp_run):
    samples, (r0, r1), ref = fsdp_run["samples"], fsdp_run["ranks"], fsdp_run["ref"]
    # The ranks' shares differ a lot in loss tokens and in packed rows (rank 1 pads).
    tokens = [sum(s.num_loss_tokens for s in part) for part in (samples[:1], samples[1:])]
    assert tokens[1] > 3 * tokens[0]
    assert len(pack_samples(samples[:1], 40)) < len(pack_samples(samples[1:], 40))
    assert r0["sharded"] and r1["sharded"]
    # AdamW state is sharded: a rank holds about half of each moment.
    assert r0["local_numel"] < r0["full_numel"]
    # Same metrics on both ranks, and the same as one process: loss, token counts, the
    # global gradient norm (binding the clip here) and the warmed-up LR.
    _same_metrics(r0["metrics1"], ref["metrics1"])
    _same_metrics(r1["metrics1"], ref["metrics1"])
    assert ref["metrics1"]["optim/grad_norm"] > FSDP_CFG["max_grad_norm"]
    assert r0["metrics1"]["lr"] == FSDP_CFG["lr"] / 2 and r0["metrics1"]["learner/loss_tokens"] == sum(tokens)
    # Gradients after clipping: only equal if the clip used the global norm and the
    # loss the global token count.
    assert set(r0["grads1"]) == set(ref["grads1"])
    for k, g in ref["grads1"].items():
        torch.testing.assert_close(r0["grads1"][k], g, rtol=1e-4, atol=1e-6, msg=k)
    total = torch.sqrt(sum(g.pow(2).sum() for g in r0["grads1"].values()))
    assert float(total) == pytest.approx(FSDP_CFG["max_grad_norm"], rel=1e-3)
    # The updated weights, after one step and after a second one (Adam moments in play).
    for got, want in ((r0["weights1"], ref["weights1"]), (r0["weights2"], ref["weights2"])):
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    _same_metrics(r0["metrics2"], ref["metrics2"])


def test_fsdp_full_weights_only_on_rank_zero(fsdp_run):
    r0, r1 = fsdp_run["ranks"]
    assert r1["weights1"] == {} and r1["weights2"] == {}
    assert ("lm_head.weight" in r0["weights1"]) != fsdp_run["tied"] and "model.embed_tokens.weight" in r0["weights1"]
    assert all(not hasattr(v, "full_tensor") and v.device.type == "cpu" for v in r0["weights1"].values())
    # A forward-only pass under FSDP: rank 0's share scored like one process scores it.
    for a, b in zip(r0["logprobs"], fsdp_run["ref"]["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)
    # Without a backward after it, the forward's gathered root unit is freed again.
    assert r0["sharded_after_logprobs"] and r1["sharded_after_logprobs"]


def test_fsdp_checkpoint_is_the_full_model_and_optimizer(fsdp_run):
    from transformers import AutoModelForCausalLM

    from tmax.training.learner import checkpoint as ckpt

    ref, ckpt_dir = fsdp_run["ref"], fsdp_run["ckpt"]
    saved = AutoModelForCausalLM.from_pretrained(str(ckpt_dir)).state_dict()
    for k, v in ref["weights1"].items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-6, msg=k)
    state = ckpt.load_trainer_state(ckpt_dir)
    assert state["step"] == 1 and state["extra"] == {"note": "fsdp"}
    # The same index-keyed layout a single process writes, with full tensors.
    want = ref["optim1"]
    assert state["optimizer"]["param_groups"] == want["param_groups"]
    assert set(state["optimizer"]["state"]) == set(want["state"])
    for idx, entry in want["state"].items():
        for key, v in entry.items():
            torch.testing.assert_close(state["optimizer"]["state"][idx][key], v, rtol=1e-4, atol=1e-6)


def test_fsdp_resume_restores_step_optimizer_and_weights(fsdp_run):
    r0, r1 = fsdp_run["ranks"]
    for r in (r0, r1):
        assert r["step_resumed"] == 1 and r["extra_resumed"] == {"note": "fsdp"}
    assert r0["optim_resumed"]["param_groups"] == r0["optim1"]["param_groups"]
    assert set(r0["optim_resumed"]["state"]) == set(r0["optim1"]["state"]) != set()
    for idx, entry in r0["optim1"]["state"].items():
        for key, v in entry.items():
            assert torch.equal(r0["optim_resumed"]["state"][idx][key], v), (idx, key)
    for k, v in r0["weights1"].items():
        assert torch.equal(r0["weights_resumed"][k], v), k
    # The resumed learner continues exactly like the one that wrote the checkpoint.
    _same_metrics(r0["metrics2_resumed"], r0["metrics2"])
    for k, v in r0["weights2"].items():
        assert torch.equal(r0["weights2_resumed"][k], v), k
    # And one process resumes the two-rank checkpoint too (same format on disk).
    single = Learner.load(fsdp_run["ckpt"], LearnerConfig(**FSDP_CFG))
    assert single.step == 1
    single.train_step(fsdp_run["samples"])
    for k, v in fsdp_run["ref"]["weights2"].items():
        torch.testing.assert_close(single.named_weights()[k], v, rtol=0, atol=1e-6, msg=k)


def test_strategy_is_checked():
    with pytest.raises(ValueError, match="strategy must be one of fsdp, replicate"):
        LearnerConfig(strategy="ddp2")
    from tmax.training.learner.parallel import DataParallel, data_parallel
    from tmax.training.learner.parallel import RankContext

    assert type(data_parallel(RankContext(0, 1, "none", torch.device("cpu")), "fsdp")) is DataParallel
