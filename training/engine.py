"""Inference engines for training: token sampling and weight push.

`VLLMEngine` runs (or attaches to) the same vLLM OpenAI server `tmax serve` starts
(`training.serving`), in dev mode with the weight-push worker extension.

* Sampling (`sampler()` -> `agents.policy.TokenSampler`): `POST /v1/completions` with a
  token-id prompt, `return_token_ids`, `logprobs=1` (the server runs with
  `--logprobs-mode processed_logprobs`, so they are after temperature / top-p, the
  distribution the token was drawn from), `skip_special_tokens=False`, an explicit seed and
  explicit stop ids. It returns ids, logprobs, finish reason and the policy version of the
  weights that were loaded.
* Weight push (`push_weights`, the object-store / file path): the trainer's state dict
  (HF names) is written to one safetensors file (temp + rename, so the engine never reads
  half a file), then `POST /collective_rpc {"method": "push_file"}` reloads it in every
  worker (`training.vllm_ext`). About 50 ms for the nano model on CPU.
* Weight receive (`join_weight_group` once, then `receive_weights(update)` per sync, the
  process-group path of `training.distributed`: NCCL on GPU, gloo on CPU): every worker
  joins the learner's weight group, and each update is one `collective_rpc
  receive_weights` carrying the JSON manifest; the workers take the buckets by
  broadcast from learner rank 0 and load them. That HTTP call returns only once the
  broadcast is over, so learner rank 0 must send while it is pending: call it from
  another thread (`receive_weights_async`) or another actor, never before the send on
  the sender's own thread.

Either way a sync pauses the engine instead of draining it: `POST /pause?mode=keep`
freezes the requests in flight where they are (nothing is aborted, nothing waits for
them), the weights load, `POST /reset_prefix_cache?reset_running_requests=true` drops
every KV block computed with the old weights (the frozen requests are preempted, so on
`POST /resume` they recompute their prefix and go on sampling with the new weights),
and generation resumes. A turn that spans a sync thus holds tokens of two versions; it
is tagged with the older one (the version read before its request was sent), so the
staleness limit, which measures the oldest turn of an episode, never under-counts; the
engine counts such turns in `mixed_turns`. Each token's logprob is the exact
probability it was drawn with either way.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agents.policy import (
    ContextOverflow,
    FatalModelError,
    ModelError,
    SampledTokens,
    TokenSampler,
)
from training.serving import ServerError, ServeSpec, VLLMServer, free_port

if TYPE_CHECKING:
    import torch

    from training.distributed import WeightUpdate


class EngineError(RuntimeError):
    """The engine failed (server down, a push rejected): an infrastructure failure."""


@runtime_checkable
class InferenceEngine(Protocol):
    base_url: str  # OpenAI base URL (".../v1")

    def sampler(self, seed_base: int = 0) -> TokenSampler: ...

    def push_weights(self, weights: dict[str, "torch.Tensor"], version: int) -> float: ...

    def close(self) -> None: ...


def _post(client: Any, url: str, body: dict | None, timeout: float) -> Any:
    import httpx

    try:
        r = client.post(url, json=body, timeout=timeout)
    except httpx.TimeoutException as e:
        raise ModelError(f"timeout after {timeout:.0f} s: POST {url}") from e
    except httpx.HTTPError as e:
        raise ModelError(f"connection error: POST {url}: {e}") from e
    if r.status_code >= 500 or r.status_code == 429:
        raise ModelError(f"HTTP {r.status_code} from POST {url}: {r.text[:500]}")
    if r.status_code >= 400:
        text = r.text[:1000]
        low = text.lower()
        if "maximum context length" in low or "max_model_len" in low or "too long" in low:
            raise ContextOverflow(f"HTTP {r.status_code}: {text}")
        raise FatalModelError(f"HTTP {r.status_code} from POST {url}: {text}")
    return r.json() if r.content else None


class VLLMSampler:
    """`TokenSampler` over `/v1/completions`. Thread-safe; picklable (for Ray actors): a
    copy in another process has no engine to ask, and reads the policy version from the
    server instead (`/collective_rpc policy_version`)."""

    def __init__(
        self,
        url: str,
        model: str,
        seed_base: int = 0,
        stop_token_ids: list[int] | None = None,
        engine: "VLLMEngine | None" = None,
        timeout_s: float = 600.0,
        max_model_len: int | None = None,
        extra_body: dict | None = None,
    ):
        self.url = url.rstrip("/")
        # Further vLLM sampling fields for every request (e.g. min_tokens, ignore_eos).
        self.extra_body = dict(extra_body or {})
        self.model = model
        self.seed_base = seed_base
        self.stop_token_ids = list(stop_token_ids or [])
        self.timeout_s = timeout_s
        self.max_model_len = max_model_len
        self._engine = engine
        self._counter = itertools.count()
        self._client: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_engine=None, _client=None, _counter=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _http(self) -> Any:
        with self._lock:
            if self._client is None:
                import httpx

                self._client = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
            return self._client

    def _remote_version(self) -> int:
        res = _post(self._http(), self.url + "/collective_rpc", {"method": "policy_version"}, 30.0)
        return int(res["results"][0])

    def sample(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
    ) -> SampledTokens:
        # Unseeded calls get seed_base + a per-sampler counter, so runs are reproducible.
        seed = seed if seed is not None else self.seed_base + next(self._counter)
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room <= 0:
                raise ContextOverflow(
                    f"prompt of {len(prompt_ids)} tokens leaves no room in the {self.max_model_len}-token context"
                )
            # The server rejects prompt + max_tokens > context; generating into the room
            # that is left and stopping with "length" is what a budget means.
            max_tokens = min(int(max_tokens), room)
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "seed": int(seed),
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": self.stop_token_ids,
            **self.extra_body,
        }
        if self._engine is not None:
            # Read before sending: a sync during the request makes this the older of the
            # turn's two versions (see the module docstring).
            eng = self._engine
            version, syncs = eng.policy_version, eng.syncs_started
            data = _post(self._http(), self.url + "/v1/completions", body, self.timeout_s)
            if eng.syncs_started != syncs:
                eng._count_mixed()
        else:
            version = self._remote_version()
            data = _post(self._http(), self.url + "/v1/completions", body, self.timeout_s)
        choice = data["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise FatalModelError("the server returned no token_ids (a vLLM without return_token_ids?)")
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(lps) != len(ids):
            raise ModelError(f"server returned {len(ids)} token ids but {len(lps)} logprobs")
        # vLLM reports -inf as null / -9999 for impossible tokens; keep a float either way.
        logprobs = [float(x) if x is not None else float("-inf") for x in lps]
        return SampledTokens(ids=list(ids), logprobs=logprobs, finish_reason=choice.get("finish_reason"), policy_version=version)


def _stop_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json / config.json, passed explicitly with every
    request (the server ignores the model's generation config in dev mode)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


class VLLMEngine:
    """A vLLM server for one model, started here (or attached to), with weight push.

    `VLLMEngine(model_dir)` starts a dev-mode server on a free port; `VLLMEngine(model_dir,
    url=...)` attaches to one already running (started with `tmax serve --dev`)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        url: str | None = None,
        served_model_name: str = "policy",
        port: int | None = None,
        max_model_len: int | None = 4096,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        kv_cache_gb: int = 1,
        extra_args: list[str] | None = None,
        work_dir: str | Path | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
    ):
        self.model_dir = Path(model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise EngineError(f"{self.model_dir}: not a model directory (no config.json)")
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.stop_token_ids = _stop_ids(self.model_dir)
        self.policy_version = 0
        self.request_timeout_s = request_timeout_s
        # One weight sync at a time; samples never wait for one (the server pauses them).
        self._sync_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.syncs_started = 0
        self.mixed_turns = 0  # turns whose request was in flight while a sync started
        self.weight_group: dict | None = None
        self._bg: ThreadPoolExecutor | None = None
        self._client: Any = None
        self._owned_tmp: tempfile.TemporaryDirectory | None = None
        if work_dir is None:
            self._owned_tmp = tempfile.TemporaryDirectory(prefix="tmax-engine-")
            work_dir = self._owned_tmp.name
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.server: VLLMServer | None = None
        self.max_model_len: int | None = None
        if url is not None:
            self.url = url.rstrip("/").removesuffix("/v1")
            self.served_model_name = served_model_name
            self._check_attached()
        else:
            spec = ServeSpec(
                model=str(self.model_dir),
                served_model_name=served_model_name,
                port=port or free_port(),
                max_model_len=max_model_len,
                dtype=dtype,
                enforce_eager=enforce_eager,
                kv_cache_gb=kv_cache_gb,
                dev=True,
                extra_args=list(extra_args or []),
            )
            self.server = VLLMServer(spec, log_path=self.work_dir / "vllm.log")
            self.url = self.server.url
            self.served_model_name = self.server.served_model_name
            try:
                self.server.start()
                self.server.wait_healthy(startup_timeout_s)
            except ServerError as e:
                self.close()
                raise EngineError(f"vLLM engine did not start: {e}") from e
            self.max_model_len = self._served_max_len()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.Client()
        return self._client

    def _models(self) -> list[dict]:
        import httpx

        try:
            return self._http().get(self.url + "/v1/models", timeout=10).json().get("data", [])
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise EngineError(f"no vLLM server at {self.url}: {e}") from e

    def _served_max_len(self) -> int | None:
        for m in self._models():
            if m.get("id") == self.served_model_name and isinstance(m.get("max_model_len"), int):
                return m["max_model_len"]
        return None

    def _check_attached(self) -> None:
        names = [m.get("id") for m in self._models()]
        if self.served_model_name not in names:
            if len(names) == 1:
                self.served_model_name = names[0]
            else:
                raise EngineError(f"{self.url} serves {names}, not {self.served_model_name!r}")
        self.max_model_len = self._served_max_len()
        try:
            self.policy_version = int(self._rpc("policy_version")[0])
        except (EngineError, ModelError, FatalModelError) as e:
            raise EngineError(
                f"{self.url} has no weight-push extension (start it with `tmax serve --dev`): {e}"
            ) from e

    def sampler(self, seed_base: int = 0) -> VLLMSampler:
        return VLLMSampler(
            self.url,
            self.served_model_name,
            seed_base=seed_base,
            stop_token_ids=self.stop_token_ids,
            engine=self,
            timeout_s=self.request_timeout_s,
            max_model_len=self.max_model_len,
        )

    def _rpc(self, method: str, *args: str, timeout: float = 300.0) -> list:
        try:
            res = _post(self._http(), self.url + "/collective_rpc", {"method": method, "args": list(args)}, timeout)
        except (ModelError, FatalModelError) as e:
            raise EngineError(f"collective_rpc {method} failed: {e}") from e
        if not isinstance(res, dict) or "results" not in res:
            raise EngineError(f"collective_rpc {method}: unexpected reply {res!r}")
        return res["results"]

    def push_weights(self, weights: dict[str, "torch.Tensor"], version: int) -> float:
        """Load `weights` (HF names) into the running engine through a file; returns
        seconds taken. The fallback of the process-group path (`receive_weights`)."""
        import torch
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        state = {}
        for name, t in weights.items():
            if self.tied and name == "lm_head.weight":
                continue  # the engine's LM head is the embedding
            state[name] = t.detach().to("cpu", torch.float32).contiguous()
        if not state:
            raise EngineError("push_weights got no tensors")
        path = self.work_dir / "weights.safetensors"
        fd, tmp = tempfile.mkstemp(dir=self.work_dir, prefix=".weights-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(state, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._sync(lambda: self._rpc("push_file", str(path), str(int(version))), len(state), version)
        return time.perf_counter() - t0

    # -- process-group transport -------------------------------------------------------

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                          backend: str = "gloo", timeout_s: float = 300.0) -> list[dict]:
        """Every worker of this engine joins the weight group whose rank 0 (learner rank
        0) serves the TCPStore at host:port; worker ranks are rank_offset + TP rank.
        Blocks until all ranks have joined: the learner must join at the same time."""
        spec = json.dumps({"host": host, "port": int(port), "rank_offset": int(rank_offset),
                           "world_size": int(world_size), "backend": backend, "timeout_s": float(timeout_s)})
        results = self._rpc("join_weight_group", spec, timeout=timeout_s + 60)
        ranks = sorted(int(r["rank"]) for r in results if isinstance(r, dict) and "rank" in r)
        if len(ranks) != len(results) or not ranks:
            raise EngineError(f"join_weight_group: unexpected worker replies {results}")
        self.weight_group = {"host": host, "port": int(port), "ranks": ranks, "world_size": int(world_size),
                             "backend": backend, "timeout_s": float(timeout_s)}
        return results

    def receive_weights(self, update: "WeightUpdate") -> float:
        """Take one update by broadcast from learner rank 0 (which must be sending it
        meanwhile, see `receive_weights_async`) into the paused engine; returns seconds."""
        if self.weight_group is None:
            raise EngineError("receive_weights before join_weight_group")
        t0 = time.perf_counter()
        timeout = self.weight_group["timeout_s"] + 60
        self._sync(lambda: self._rpc("receive_weights", update.to_json(), timeout=timeout),
                   len(update.names), update.version)
        return time.perf_counter() - t0

    def join_weight_group_async(self, *args: Any, **kwargs: Any) -> Future:
        return self._background(self.join_weight_group, *args, **kwargs)

    def receive_weights_async(self, update: "WeightUpdate") -> Future:
        """`receive_weights` on a background thread: start it, broadcast, then wait."""
        return self._background(self.receive_weights, update)

    def num_workers(self) -> int:
        """vLLM workers behind this server (its TP size): each is a rank of the group."""
        return len(self._rpc("policy_version"))

    def leave_weight_group(self) -> None:
        if self.weight_group is not None:
            self.weight_group = None
            self._rpc("leave_weight_group")

    def _background(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        if self._bg is None:
            self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tmax-weights")
        return self._bg.submit(fn, *args, **kwargs)

    # -- pause / resume ----------------------------------------------------------------

    def is_paused(self) -> bool:
        import httpx

        try:
            return bool(self._http().get(self.url + "/is_paused", timeout=30).json()["is_paused"])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise EngineError(f"GET /is_paused failed: {e}") from e

    def _control(self, path: str, timeout: float = 120.0) -> Any:
        try:
            return _post(self._http(), self.url + path, None, timeout)
        except (ModelError, FatalModelError) as e:
            raise EngineError(f"POST {path} failed (a dev-mode vLLM server with the RL endpoints?): {e}") from e

    def _sync(self, load: Any, n_expected: int, version: int) -> None:
        """Pause (requests in flight stay frozen), load, drop the old KV, resume."""
        with self._sync_lock:
            with self._stats_lock:
                self.syncs_started += 1
            self._control("/pause?mode=keep&clear_cache=false")
            try:
                results = load()
                bad = [r for r in results if not isinstance(r, dict) or r.get("n_tensors") != n_expected]
                if bad:
                    raise EngineError(f"weight sync incomplete: sent {n_expected} tensors, workers answered {results}")
                # Frozen requests hold KV blocks of the old weights: preempt them (they
                # recompute on resume) so that the whole prefix cache can go.
                reset = self._control("/reset_prefix_cache?reset_running_requests=true", 60.0)
                if isinstance(reset, dict) and reset.get("success") is False:
                    raise EngineError("reset_prefix_cache refused after a weight sync")
                # Before resuming: a turn sent from now on runs on the new weights only.
                self.policy_version = int(version)
            finally:
                self._control("/resume")

    def _count_mixed(self) -> None:
        with self._stats_lock:
            self.mixed_turns += 1

    def close(self) -> None:
        if self._bg is not None:
            self._bg.shutdown(wait=False, cancel_futures=True)
            self._bg = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._owned_tmp is not None:
            self._owned_tmp.cleanup()
            self._owned_tmp = None

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
