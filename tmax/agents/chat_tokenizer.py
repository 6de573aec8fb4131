"""A model's tokenizer and chat template without transformers (and so without torch).

`tmax run` records sessions at token level (`agents.token_policy.TokenPolicy`) without
the training stack: `tokenizers` reads tokenizer.json, jinja2 renders the chat template
the way transformers does (sandboxed, trim_blocks / lstrip_blocks, loop controls, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and
`{% generation %}` blocks rendered as plain text). tests/integration/test_run_tokens.py checks that
the text and the ids equal transformers' for the same conversation.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2.ext import Extension
    from jinja2.nodes import Node
    from jinja2.parser import Parser


def _generation_extension() -> type[Extension]:
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for masks; here it is
        just its body."""

        tags = {"generation"}

        def parse(self, parser: Parser) -> Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationBlocks


def _tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out in full
        return value.get("content")
    return value


class ChatTokenizer:
    """The subset of a transformers tokenizer that TokenPolicy uses."""

    def __init__(self, model_dir: str | Path) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if not isinstance(template, str):
            raise ValueError(f"{d} has no chat template (chat_template.jinja or a string in tokenizer_config.json)")
        self.special_tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.eos_token = self.special_tokens["eos_token"]
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_extension(), loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        text = self._template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**{k: v for k, v in self.special_tokens.items() if v is not None}, **kwargs})
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
