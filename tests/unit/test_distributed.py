"""The weight protocol's buckets and the backends' checks. Real rank groups (torch.distributed
gloo in separate processes, FSDP2) are in tests/integration/test_distributed_gloo.py."""

from __future__ import annotations

import pytest
import torch

from tmax.training.learner import parallel as D
from tmax.training.net import free_port
from tmax.training.weights import protocol as P
from tmax.training.weights.group import WeightGroup


def test_buckets_roundtrip_mixed_dtypes():
    w = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.randn(100, 100),
        "d": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }
    upd = P.make_update(w, version=3, transport="gloo", bucket_mb=0.02)
    assert sorted(i for _, idx in upd.buckets for i in idx) == [0, 1, 2, 3]
    assert len(upd.buckets) >= 3  # the big tensor is alone in its bucket
    got = {}
    for b, (dtype, idx) in enumerate(upd.buckets):
        flat = P.pack_bucket([list(w.values())[i] for i in idx])
        assert str(flat.dtype) == f"torch.{dtype}"
        got.update({n: t.clone() for n, t in P.unpack_bucket(upd, b, flat)})
    for k in w:
        assert torch.equal(got[k], w[k]) and got[k].dtype == w[k].dtype
    with pytest.raises(ValueError, match="elements received"):
        list(P.unpack_bucket(upd, 0, torch.zeros(7)))


def test_backend_errors():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            D.pick_backend("nccl")
    with pytest.raises(ValueError, match="nccl or gloo"):
        D.pick_backend("mpi")
    with pytest.raises(ValueError, match="gloo or nccl"):
        WeightGroup("127.0.0.1", free_port(), 0, 1, backend="mpi", timeout_s=5)
