"""The learner over two real ranks (torch.distributed gloo, separate processes): replicated
data parallelism and FSDP2 take exactly the single-process step, and an FSDP2 checkpoint
resumes at any world size. On the tiny model of tests/tiny_learner.py."""

import copy
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from tiny_learner import grads, make_model_dir, sampled_batch
from tmax.training.learner.learner import Learner, LearnerConfig
from tmax.training.learner.packing import pack_samples
from tmax.common.records import CheckpointExtra


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


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
    learner.save(ckpt_dir, extra=CheckpointExtra(config="fsdp"))
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
        step_resumed=step_resumed, extra_resumed=resumed.extra.config, optim_resumed=optim_resumed,
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
    assert state["step"] == 1 and ckpt.checkpoint_meta(ckpt_dir).extra.config == "fsdp"
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
        assert r["step_resumed"] == 1 and r["extra_resumed"] == "fsdp"
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
