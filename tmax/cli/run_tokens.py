"""Sessions that train the model: `tmax run --tokens` samples token ids through a vLLM
server (`tmax serve`) and records the session as `tokens.json`, exactly like a `tmax learn`
rollout. (`/good`, `/bad` and `--verify CMD`, which store its reward, are `agents.rating`.)

Nothing here imports torch or transformers: the tokenizer and chat template come from
`agents.chat_tokenizer`, the sampler is training's `VLLMSampler` over HTTP (with a fixed
policy version: a plain `tmax serve` has no weight-sync endpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmax.common.errors import ConfigError
from tmax.training.inference.engine import VLLMSampler, stop_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tmax.agents.agent_settings import AgentSettings
    from tmax.agents.token_policy import TokenPolicy


def _model_card(base_url: str, model: str, api_key: str | None) -> dict[str, Any]:
    import httpx

    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        cards = httpx.get(url, headers=headers, timeout=10).json().get("data", [])
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise ConfigError(f"--tokens: could not list the models at {url}: {e}") from e
    for card in cards:
        if card.get("id") == model:
            # A LoRA adapter's card has no context length: its base model's (`parent`) holds.
            parent = next((c for c in cards if card.get("parent") and c.get("id") == card["parent"]), {})
            return card if card.get("max_model_len") else card | {"max_model_len": parent.get("max_model_len")}
    raise ConfigError(f"--tokens: {url} does not serve {model!r} (it serves {[c.get('id') for c in cards]})")


@dataclass
class TokenSetup:
    """What `--tokens` found out before the session starts."""

    base_url: str
    model: str
    api_key: str | None
    model_dir: Path  # where the tokenizer and chat template are read from
    max_model_len: int | None
    tokenizer: PreTrainedTokenizerBase

    def policy(self, config: AgentSettings) -> TokenPolicy:
        from tmax.agents.token_policy import TokenPolicy

        server = self.base_url.rstrip("/").removesuffix("/v1")
        stops = sorted({*stop_ids(self.model_dir), self.tokenizer.eos_token_id} - {None})
        # A plain `tmax serve`: no weight-sync endpoints, the weights fixed for the session.
        sampler = VLLMSampler(server, self.model, stop_token_ids=stops, max_model_len=self.max_model_len,
                              fixed_version=0, api_key=self.api_key)
        window = self.max_model_len or config.context_budget
        return TokenPolicy(sampler, self.tokenizer, temperature=config.temperature, top_p=config.top_p,
                           max_response_tokens=window, max_context_tokens=window, max_turn_tokens=config.max_tokens)


def prepare_tokens(base_url: str, model: str, api_key: str | None, tokenizer_dir: Path | None) -> TokenSetup:
    """Check the server and find the tokenizer: --tokenizer, else the served model's directory."""
    from tmax.agents.chat_tokenizer import ChatTokenizer

    card = _model_card(base_url, model, api_key)
    root = tokenizer_dir or (Path(card["root"]) if isinstance(card.get("root"), str) else None)
    if root is None or not (root / "tokenizer.json").is_file():
        raise ConfigError(f"--tokens needs the model's tokenizer: {model!r} is served from {card.get('root')!r}, "
                          "which is not a directory with tokenizer.json here; pass --tokenizer DIR")
    try:
        tokenizer = ChatTokenizer(root)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokens: cannot read the tokenizer in {root}: {e}") from e
    max_len = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) else None
    return TokenSetup(base_url, model, api_key, root.resolve(), max_len, tokenizer)
