"""LoRA over two FSDP2 learner ranks (a real gloo group, one process each): the adapter's
step, the tensors rank 0 hands the engines and the checkpoint equal one process's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from tiny_learner import make_model_dir, max_diff, sampled_batch  # noqa: E402

from tmax.training.learner.learner import Learner, LearnerConfig  # noqa: E402
from tmax.training.learner.lora import LoraSpec  # noqa: E402
from tmax.training.weights.adapter import is_adapter_dir  # noqa: E402

SPEC = LoraSpec(rank=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def _fsdp_lora_rank(rank: int, port: int, model_dir: str, data: str, out: str) -> None:
    """One of two FSDP2 ranks training the adapter: a step on half the batch, the adapter's
    tensors for the engines, a checkpoint."""
    from tmax.training.learner import parallel as D

    torch.set_num_threads(1)
    ctx = D.init_learner_group(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=180)
    learner = Learner(model_dir, LearnerConfig(lr=1e-2, lora=SPEC), D.data_parallel(ctx, "fsdp"))
    samples = torch.load(data, weights_only=False)
    metrics = learner.train_step(samples[:2] if rank == 0 else samples[2:])
    weights = learner.named_weights()
    learner.save(f"{out}/ckpt", step=1)
    torch.save({"metrics": metrics, "weights": weights, "nbytes": learner.sync_nbytes()}, f"{out}/rank{rank}.pt")
    D.destroy_learner_group()


def test_two_fsdp_ranks_train_the_adapter_as_one_process(model_dir, tmp_path):
    import torch.multiprocessing as mp

    from tmax.training.net import free_port

    samples = sampled_batch(model_dir)
    torch.save(samples, tmp_path / "samples.pt")
    mp.spawn(_fsdp_lora_rank, args=(free_port(), str(model_dir), str(tmp_path / "samples.pt"), str(tmp_path)),
             nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    single = Learner(model_dir, LearnerConfig(lr=1e-2, lora=SPEC))
    want = single.train_step(samples)
    assert r0["metrics"]["optim/grad_norm"] == pytest.approx(want["optim/grad_norm"], rel=1e-4)
    assert r1["weights"] == {} and r0["nbytes"] == single.sync_nbytes()  # rank 0 hands the engines the adapter
    ref = single.named_weights()
    assert set(r0["weights"]) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(r0["weights"][k], v, rtol=0, atol=1e-6, msg=k)
    assert is_adapter_dir(tmp_path / "ckpt")
    resumed = Learner.load(tmp_path / "ckpt", LearnerConfig(lora=SPEC))
    assert max_diff(resumed.logprobs(samples), single.logprobs(samples)) < 1e-5
