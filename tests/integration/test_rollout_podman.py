"""Training episodes in podman containers: the task image built up front, the task's
limits, a warm pool, the verifier in the container, and a container killed mid-episode.

Real podman, real images, real verifier; the sampler is scripted (pre-rendered turns)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.sandbox.pool import WarmPool
from tmax.training.config import preset
from tmax.training.rollout import (
    ROLLOUT_LABEL, EpisodeRequest, EpisodeSettings, InfraError, prepare_tasks, prewarm, run_episode,
)
from tmax.training.demos import ScriptedSampler, scripted_turns

pytestmark = pytest.mark.podman


@pytest.fixture(scope="module")
def nano(tmp_path_factory, base_image):
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("nano-podman")
    tok = build_tokenizer(0)
    tok.save_pretrained(root / "tok")
    splits = write_splits(root / "tasks", 3, 1, seed=0)
    # A container of its own per episode (`rollout.overlay = false`): every task image built up front.
    cfg = EpisodeSettings.of(preset("nano-podman").rollout.model_copy(update={"overlay": False}))
    broken = root / "broken" / "needs-a-missing-base"
    shutil.copytree(splits["train"][0], broken)
    (broken / "environment" / "Dockerfile").write_text("FROM localhost/tmax-no-such-base:1\nWORKDIR /app\n")
    dirs = [str(d) for d in splits["train"]] + [str(broken)]
    prepared = prepare_tasks(cfg.env, dirs, root / "report.json", log=lambda m: None)
    return AutoTokenizer.from_pretrained(root / "tok"), splits, cfg, prepared, str(broken)


def _oracle_turns(tok, task_dir):
    from tmax.training.nano.tasks import oracle_steps

    return scripted_turns(tok, oracle_steps(task_dir))


def test_images_resolved_up_front_and_unbuildable_dropped(nano):
    _, splits, _, prepared, broken = nano
    assert set(prepared.runnable) == {str(d) for d in splits["train"]}
    assert broken in prepared.dropped and "tmax-no-such-base" in prepared.dropped[broken]
    assert all(img.tag.startswith("localhost/tmax-task/") for img in prepared.images.values())


def test_oracle_episode_runs_and_is_verified_in_its_container(nano):
    tok, splits, cfg, prepared, _ = nano
    task = str(splits["train"][0])
    r = run_episode(EpisodeRequest(task, 0, 0, 1), ScriptedSampler(_oracle_turns(tok, task)), tok, cfg,
                    image=prepared.images[task])
    assert r.reward == 1.0 and r.submitted and r.sandbox == "podman"
    assert r.container_id and len(r.container_id) == 64
    assert r.verifier["in_sandbox"] == "podman" and r.verifier["status"] == "ok"


def test_limits_from_task_toml_and_no_tests_before_submit(nano):
    tok, splits, cfg, prepared, _ = nano
    task = str(splits["train"][1])
    # cgroup v1 or v2 file names
    [look] = scripted_turns(tok, [("THOUGHT: look.", "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || "
                                   "cat /sys/fs/cgroup/cpu.max; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null"
                                   " || cat /sys/fs/cgroup/memory.max; ls /sys/class/net; ls /tests /logs/verifier")])
    c = EpisodeSettings.of(preset("nano-podman").rollout.model_copy(update={
        "max_steps": 2, "observation_max_chars": 2000, "max_tokens": 300, "response_budget": 1000,
        "context_budget": 2048}))
    r = run_episode(EpisodeRequest(task, 0, 0, 1), ScriptedSampler([look, look]), tok, c,
                    image=prepared.images[task])
    obs = tok.decode([i for i, m in zip(r.trace.ids, r.trace.mask) if m == 0])
    assert "100000" in obs  # cpus = 1: a quota of one period
    assert str(512 * 1024 * 1024) in obs  # memory_mb = 512
    assert "eth0" not in obs and "lo" in obs  # allow_internet = false: no network
    assert "expected.txt" not in obs and "No such file or directory" in obs


def test_warm_pool_hands_out_a_fresh_started_container(nano):
    tok, splits, cfg, prepared, _ = nano
    task = str(splits["train"][2])
    [submit] = scripted_turns(tok, [("THOUGHT: done.", SUBMIT_COMMAND)])
    settings = cfg.env
    with WarmPool(2) as pool:
        assert prewarm(pool, task, settings, prepared.images[task])
        deadline = time.monotonic() + 60
        while not pool._idle_count() and time.monotonic() < deadline:
            time.sleep(0.2)
        ids = []
        for i in range(2):
            r = run_episode(EpisodeRequest(task, 0, i, 1), ScriptedSampler([submit]), tok, cfg,
                            image=prepared.images[task], pool=pool)
            assert r.reward == 0.0 and r.verifier["status"] == "ok"
            ids.append((r.container_id, r.warm_start))
    assert ids[0][1] and not ids[1][1]  # the first came warm, the second started cold
    assert ids[0][0] != ids[1][0]  # never reused
    gone = subprocess.run(["podman", "ps", "-aq", "--no-trunc", "--filter", f"id={ids[0][0]}"],
                          capture_output=True, text=True)
    assert gone.stdout.strip() == ""


def test_container_killed_mid_episode_is_an_infra_error(nano):
    tok, splits, _, prepared, _ = nano
    # A command timeout above the `sleep 30`: the kill lands mid-command however slowly a
    # loaded machine lists and kills the container.
    cfg = EpisodeSettings.of(preset("nano-podman").rollout.model_copy(update={"command_timeout": 60.0}))
    task = str(splits["train"][0])
    [wait] = scripted_turns(tok, [("THOUGHT: wait.", "sleep 30")])
    label = f"{ROLLOUT_LABEL}={splits['train'][0].name}"
    killed: list[str] = []

    def kill_it() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            ps = subprocess.run(["podman", "ps", "-q", "--filter", f"label={label}"], capture_output=True, text=True)
            for cid in ps.stdout.split():
                time.sleep(1.0)  # let the agent's `sleep 30` start
                subprocess.run(["podman", "kill", cid], capture_output=True)
                killed.append(cid)
            time.sleep(0.2)

    t = threading.Thread(target=kill_it, daemon=True)
    t.start()
    with pytest.raises(InfraError) as e:
        run_episode(EpisodeRequest(task, 0, 0, 1), ScriptedSampler([wait, wait]), tok, cfg,
                    image=prepared.images[task])
    t.join(5)
    assert killed and e.value.kind == "sandbox_died"
