"""A command's flags made from its settings' declaration (`common.settings`): each flagged
field becomes an option with the field's help and default, its old spellings hidden
options that still work with a one-line note. The command receives what was typed as
`FlagValues`, a layer for `common.settings.resolve_layers`.

    @app.command()
    @setting_flags(LearnConfig, "learn", shared=[CONFIG])
    def nano(ctx: typer.Context, config: Path | None, flags: FlagValues) -> None: ...

`shared` adds other options (not settings: the config file, --print-config) to the same
command, so a group and its subcommands can take the same options, each after its own name.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import typer
from pydantic import BaseModel

from tmax.common.settings import FlagSpec, choices, flag_specs, set_path, value_type


@dataclass
class FlagValues:
    """The settings flags set: dotted key -> value, and the flag each came from."""

    values: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def layer(self) -> tuple[dict, dict[str, str]]:
        nested: dict = {}
        for key, value in self.values.items():
            set_path(nested, tuple(key.split(".")), value)
        return nested, dict(self.labels)

    def over(self, base: FlagValues | None) -> FlagValues:
        """These flags on top of `base`'s (a subcommand's over its group's)."""
        if base is None:
            return self
        return FlagValues({**base.values, **self.values}, {**base.labels, **self.labels})

    def flat(self) -> dict[str, Any]:
        """The values by the last part of their key (for flat settings)."""
        return {key.rsplit(".", 1)[-1]: value for key, value in self.values.items()}


def _param_name(spec: FlagSpec) -> str:
    return "flag_" + spec.name.split("/")[0].lstrip("-").replace("-", "_")


def _annotation(spec: FlagSpec) -> Any:
    t = value_type(spec.field.annotation)
    if choices(spec.field.annotation) is not None:
        return Optional[t]  # a Literal: typer checks and shows the choices
    if getattr(t, "__origin__", None) in (list, tuple) or t in (list, tuple):
        return Optional[list[str]]
    return Optional[t] if t in (bool, int, float, str) else Optional[str]


def _decls(names: tuple[str, ...], is_bool: bool) -> tuple[str, ...]:
    if not is_bool or any("/" in n for n in names):  # a bool's own pair: `--overlay/--fresh-containers`
        return names
    longs = [n for n in names if n.startswith("--")]
    return tuple(f"{n}/--no-{n[2:]}" for n in longs)


SETTINGS_PANEL = "Settings (also TOML keys and TMAX_* variables; --print-config)"


def _option(spec: FlagSpec, names: tuple[str, ...], hidden: bool, with_default: bool,
            defaults: Mapping[str, Any] | None = None, panel: str = SETTINGS_PANEL) -> Any:
    is_bool = value_type(spec.field.annotation) is bool
    return typer.Option(None, *_decls(names, is_bool), help=spec.help(with_default, defaults), hidden=hidden, show_default=False,
                        rich_help_panel=panel)


def note_old_spelling(old: str, new: str) -> None:
    """The one-line note an old spelling of a flag prints (it still works)."""
    typer.echo(f"tmax: note: {old} is now {new}; the old spelling still works for now", err=True)


def _collect(specs: list[FlagSpec], kwargs: dict[str, Any]) -> FlagValues:
    out = FlagValues()
    for spec in specs:
        name = _param_name(spec)
        value, label = kwargs.pop(name), spec.name
        old = kwargs.pop(name + "_old", None) if spec.flag.old else None
        if value is None and old is not None:
            value, label = old, "/".join(spec.flag.old)
            note_old_spelling(label, spec.name)
        if value is None or value == []:
            continue
        for path in spec.paths:
            out.values[".".join(path)] = list(value) if isinstance(value, (list, tuple)) else value
            out.labels[".".join(path)] = label
    return out


def setting_flags(model: type[BaseModel], command: str, shared: list[inspect.Parameter] = (),
                  with_defaults: bool = True, defaults: Mapping[str, Any] | None = None,
                  panel: str = SETTINGS_PANEL) -> Callable[[Callable], Callable]:
    """Give a command function the flags of `model`'s settings for `command` (and the
    `shared` parameters); it is called with `flags=FlagValues`. `with_defaults`: the help
    shows each setting's default (`defaults`, the command's own, else the declared one; not
    where a preset file sets them). `panel`: the help's heading over them."""
    own = set(model.__dict__.get("__annotations__", {}))
    specs = sorted(flag_specs(model, command), key=lambda spec: spec.paths[0][0] not in own)  # its own first

    def wrap(func: Callable) -> Callable:
        sig = inspect.signature(func)
        own = {p.name for p in shared} | {"flags"}
        params = [p for p in sig.parameters.values() if p.name not in own]
        extra = list(shared)
        for spec in specs:
            kind = inspect.Parameter.KEYWORD_ONLY
            extra.append(inspect.Parameter(_param_name(spec), kind, annotation=_annotation(spec),
                                           default=_option(spec, spec.flag.names, False, with_defaults, defaults, panel)))
            if spec.flag.old:
                extra.append(inspect.Parameter(_param_name(spec) + "_old", kind,
                                               default=_option(spec, spec.flag.old, True, False), annotation=_annotation(spec)))

        @functools.wraps(func)
        def command_function(*args: Any, **kwargs: Any) -> Any:
            return func(*args, flags=_collect(specs, kwargs), **kwargs)

        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra]
        command_function.__signature__ = sig.replace(parameters=[*params, *keyword])  # type: ignore[attr-defined]
        return command_function

    return wrap


def option_parameter(name: str, annotation: Any, option: Any) -> inspect.Parameter:
    """A `shared` parameter: a typer option under `name`."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


# `--print-config`, the same on every command whose settings are declared (`setting_flags`).
PRINT_CONFIG = option_parameter("print_config", bool, typer.Option(
    False, "--print-config", help="Print the resolved settings and where each came from, and exit."))


def print_config(lines: list[str]) -> None:
    """`--print-config`: the resolved settings and where each came from, on stdout."""
    typer.echo("\n".join(lines))
