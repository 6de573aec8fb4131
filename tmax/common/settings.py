"""Every setting declared once, and one resolver of where its value comes from.

A setting is a field of a pydantic model, declared in the prime-rl manner:

    steps: Annotated[int, Field(ge=1, description="RL steps."), Flag("--steps")] = 500

Its type, default and help text are that declaration; `Flag` (optional) names its
command-line flag, and `Env` (optional) further environment variables read after the one
its name gives. Everything else is derived from the model:

* the flags of a command and their help (`tmax.cli.options` turns `flag_specs` into options);
* the environment variables: `<PREFIX><KEY>`, nested keys joined by `__`
  (`TMAX_LEARN_ALGO__STEPS`, `TMAX_BASE_URL`);
* the TOML keys: the field names, nested sections as tables;
* the docs' settings tables (`settings_table`).

`resolve_layers` merges the sources in order (a preset or file first, then the
environment, then flags; later wins) and says where each value came from, which
`--print-config` shows (`describe`).
"""

from __future__ import annotations

import json
import os
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tmax.common.errors import ConfigError

Path_ = tuple[str, ...]
# Where a model that makes every setting optional (a patch) keeps the default each stands for.
DECLARED_DEFAULT = "declared_default"


@dataclass(frozen=True)
class Flag:
    """A setting's command-line flag. `names`: as typed, the long one first (`--env`, `-e`);
    `old`: earlier spellings, still accepted but hidden, each use a one-line note;
    `commands`: the commands that offer it (None: every command whose settings hold the field);
    `help`: where several settings share the flag, the help of the flag (default: the
    field's description)."""

    names: tuple[str, ...]
    old: tuple[str, ...] = ()
    commands: tuple[str, ...] | None = None
    help: str | None = None


def flag(*names: str, old: tuple[str, ...] = (), commands: tuple[str, ...] | None = None,
         help: str | None = None) -> Flag:
    return Flag(names, old, commands, help)


@dataclass(frozen=True)
class Env:
    """Environment variables read for a setting after its own `<PREFIX><KEY>`, in order
    (`OPENAI_BASE_URL` after `TMAX_BASE_URL`)."""

    names: tuple[str, ...]


def declared_default(info: FieldInfo) -> Any:
    """A setting's default: its own, or, in a patch, the one it stands for."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra[DECLARED_DEFAULT] if DECLARED_DEFAULT in extra else info.get_default(call_default_factory=True)


def _meta(info: FieldInfo, kind: type) -> Any:
    return next((m for m in info.metadata if isinstance(m, kind)), None)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def leaf_fields(model: type[BaseModel], prefix: Path_ = ()) -> Iterator[tuple[Path_, FieldInfo]]:
    """(path, field) of every setting of `model`, nested models' settings under their section."""
    for name, info in model.model_fields.items():
        sub = _submodel(info.annotation)
        if sub is not None:
            yield from leaf_fields(sub, (*prefix, name))
        else:
            yield (*prefix, name), info


def value_type(annotation: Any) -> Any:
    """The type of a setting without `None` and `Annotated` (`int | None` -> int)."""
    if get_origin(annotation) is typing.Annotated:
        return value_type(get_args(annotation)[0])
    if get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return value_type(rest[0]) if len(rest) == 1 else annotation
    return annotation


def choices(annotation: Any) -> tuple[str, ...] | None:
    t = value_type(annotation)
    return tuple(str(a) for a in get_args(t)) if get_origin(t) is Literal else None


@dataclass(frozen=True)
class FlagSpec:
    """One flag of a command and the settings it sets (one or more paths)."""

    flag: Flag
    paths: tuple[Path_, ...]
    field: FieldInfo

    @property
    def name(self) -> str:
        return self.flag.names[0]

    def help(self, with_default: bool = True, defaults: Mapping[str, Any] | None = None) -> str:
        """The flag's help; `with_default`: followed by the setting's default (the declared
        one, or the command's own in `defaults`, by dotted key)."""
        text = self.flag.help or self.field.description or ""
        key = ".".join(self.paths[0])
        default = (defaults or {}).get(key, declared_default(self.field))
        if self.field.is_required():
            return f"{text} Required."
        if with_default and default not in (None, [], {}) and not self.flag.help:
            shown = default if not isinstance(default, tuple) else ", ".join(map(str, default))
            text = f"{text} Default: {shown}."
        return text


def flag_specs(model: type[BaseModel], command: str) -> list[FlagSpec]:
    """The flags `command` offers for `model`'s settings, each once (a flag on several fields
    sets them all)."""
    found: dict[str, FlagSpec] = {}
    for path, info in leaf_fields(model):
        f = _meta(info, Flag)
        if f is None or (f.commands is not None and command not in f.commands):
            continue
        if not info.description and not f.help:
            raise TypeError(f"{'.'.join(path)}: a setting with a flag needs a description")
        spec = found.get(f.names[0])
        found[f.names[0]] = FlagSpec(f, (path,), info) if spec is None else \
            FlagSpec(spec.flag, (*spec.paths, path), spec.field)
    return list(found.values())


def env_names(path: Path_, info: FieldInfo, prefix: str) -> tuple[str, ...]:
    own = prefix + "__".join(path).upper()
    extra = _meta(info, Env)
    return (own, *(extra.names if extra else ()))


def _env_value(raw: str, info: FieldInfo | None) -> Any:
    """A variable's value: TOML (`5`, `true`, `["a"]`, `{k = 1}`) unless the setting is text."""
    if info is not None and value_type(info.annotation) is str:
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def env_layer(model: type[BaseModel], prefix: str, environ: Mapping[str, str] | None = None,
              strict: bool = False) -> tuple[dict, dict[str, str]]:
    """The settings the environment sets, nested, and the variable each came from. `strict`:
    every `<PREFIX>...` variable must name a setting (for a prefix of its own, such as
    `TMAX_LEARN_`); else variables that name none are not read."""
    environ = os.environ if environ is None else environ
    fields = dict(leaf_fields(model))
    out: dict = {}
    sources: dict[str, str] = {}
    for path, info in fields.items():
        name = next((n for n in env_names(path, info, prefix) if environ.get(n)), None)
        if name is not None:
            set_path(out, path, _env_value(environ[name], info))
            sources[".".join(path)] = f"${name}"
    if strict:
        for var, raw in sorted(environ.items()):
            if not var.upper().startswith(prefix) or not raw or f"${var}" in sources.values():
                continue
            path = tuple(var[len(prefix):].lower().split("__"))
            set_path(out, path, _env_value(raw, None), var)  # unknown: the model names it
            sources[".".join(path)] = f"${var}"
    return out, sources


def set_path(data: dict, path: Path_, value: Any, source: str = "") -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source or '.'.join(path)}: {'.'.join(path[:-1])} is not a section")
    node[path[-1]] = value


def leaves(data: Mapping, prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """(path, value) of a nested mapping's values, a mapping that is a value (`{}`) included."""
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def resolve_layers(layers: list[tuple[Mapping, str | Mapping[str, str]]]) -> tuple[dict, dict[str, str]]:
    """The layers merged in order (later wins), and where each dotted key came from: a
    layer's label, or its per-key labels (`{"algo.steps": "--steps"}`)."""
    data: dict = {}
    sources: dict[str, str] = {}
    for layer, label in layers:
        data = merge(data, layer)
        for path, _ in leaves(layer):
            key = ".".join(path)
            sources[key] = label if isinstance(label, str) else label.get(key, "?")
    return data, sources


def describe(model: BaseModel, sources: Mapping[str, str]) -> list[str]:
    """The resolved settings, one `key = value  # source` line each, sections as TOML tables."""
    lines: list[str] = []
    section: Path_ = ()
    top_first = sorted(leaf_fields(type(model)), key=lambda item: len(item[0]) > 1)  # TOML: keys before tables
    for path, info in top_first:
        value: Any = model
        for part in path:
            value = getattr(value, part)
        if path[:-1] != section:
            section = path[:-1]
            lines += [""] * bool(lines) + [f"[{'.'.join(section)}]"]
        key = ".".join(path)
        source = next((s for k, s in sources.items() if k == key or key.startswith(k + ".")), "default")
        lines.append(_setting_line(path[-1], value, source))
    return lines


def describe_values(values: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """Flat settings (`values`, by key) as `describe` shows them."""
    return [_setting_line(key, value, sources.get(key, "default")) for key, value in values.items()]


def _setting_line(key: str, value: Any, source: str) -> str:
    """`key = value  # source`, valid TOML, so the output can be saved and used as a config;
    an unset setting (TOML has no null) is a comment."""
    if value is None:
        return f"# {key} unset  # {source}"
    return f"{key} = {_shown(value)}  # {source}"


def _shown(value: Any) -> str:
    """A value as TOML writes it inline; None (in the docs' tables) as "(unset)"."""
    if value is None:
        return "(unset)"
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, str):
        return json.dumps(value)  # JSON's string escapes are TOML's basic-string escapes
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def settings_table(model: type[BaseModel], command: str, prefix: str) -> list[str]:
    """The docs' table of `model`'s settings: key, flag, environment variable, default, help."""
    rows = ["| key | flag | environment | default | meaning |", "|---|---|---|---|---|"]
    for path, info in leaf_fields(model):
        f = _meta(info, Flag)
        shown_flag = ", ".join(f"`{n}`" for n in f.names) if f and (f.commands is None or command in f.commands) else ""
        envs = ", ".join(f"`{n}`" for n in env_names(path, info, prefix))
        default = "(required)" if info.is_required() else f"`{_shown(declared_default(info))}`"
        rows.append(f"| `{'.'.join(path)}` | {shown_flag} | {envs} | {default} | "
                    f"{(info.description or '').replace('|', '/')} |")
    return rows
