"""Where `tmax run` gets its settings: command-line flags first, then environment
variables, then the user's config file, then built-in defaults.

The config file is TOML at `$XDG_CONFIG_HOME/tmax/config.toml` (`~/.config/tmax/config.toml`
when XDG_CONFIG_HOME is unset; `tmax run -c FILE` names another), with flat keys:

    base_url = "http://localhost:8000/v1"
    model = "allenai/tmax-9b"
    sandbox = "podman"
    expose = ["~/.ssh"]        # credential paths the bwrap jail may show (masked otherwise)
    max_steps = 32             # and any agent setting (`agents.agent_settings`, the names bench and learn use)

Every key, its flag, variable and default: `tmax run --print-config`, or the table in
docs/run.md (made from the declaration, `common.settings.settings_table`).

The file is validated by a pydantic model: an unknown key or a wrong type is an error
naming the key and the file. Every key is declared once (`RunKeys`, and the agent's in
`agents.agent_settings`) with its flag and help; each is also the variable `TMAX_<KEY>`
(`TMAX_BASE_URL`, then `OPENAI_BASE_URL`; `TMAX_API_KEY`, then `OPENAI_API_KEY`). One
resolver (`common.settings.resolve_layers`) merges file, environment and flags, later
winning, and records where each value came from (`tmax run --print-config`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from tmax.agents.policy import DEFAULT_MODEL_TIMEOUT_S
from tmax.agents.agent_settings import AgentSettings, AgentSettingsPatch
from tmax.common.errors import ConfigError, validation_message
from tmax.common.files import read_toml
from tmax.common.settings import Env, env_layer, env_names, flag, flag_specs, resolve_layers
from tmax.sandbox.base import KINDS as SANDBOX_KINDS
from tmax.sandbox.podman import DEFAULT_IMAGE

MODES = ("confirm", "yolo")
# Every setting of `tmax run` is also `TMAX_<KEY>` (`TMAX_BASE_URL`, `TMAX_MAX_STEPS`); a few
# read a further variable after it (`Env`). A stray $MODEL or $SANDBOX is not read.
ENV_PREFIX = "TMAX_"


class RunKeys(AgentSettingsPatch):  # type: ignore[misc,valid-type]
    """The settings of `tmax run` that a flag, a variable or the config file can set: its
    own, and every agent setting (`agents.agent_settings`). None: the default depends on another
    setting or the machine (see `resolve_run_settings`)."""

    base_url: Annotated[str | None, Field(description="OpenAI-compatible API URL."), flag("--base-url"),
                        Env(("OPENAI_BASE_URL",))] = None
    model: Annotated[str | None, Field(description="Model name (unset: the server's only model)."),
                     flag("--model", "-m")] = None
    api_key: Annotated[str, Field(description="API key (local servers accept any)."), flag("--api-key"),
                       Env(("OPENAI_API_KEY",))] = "EMPTY"
    sandbox: Annotated[Literal[SANDBOX_KINDS] | None, Field(  # type: ignore[valid-type]
        description="Where the commands run: local, bwrap or podman (unset: bwrap where it works, else local)."),
        flag("--env", "-e", old=("--sandbox", "-s"))] = None
    mode: Annotated[Literal[MODES] | None, Field(  # type: ignore[valid-type]
        description="confirm (ask before each command) or yolo (unset: confirm for local, yolo for bwrap/podman)."),
        flag("--mode")] = None
    image: Annotated[str, Field(description="The podman image."), flag("--image")] = DEFAULT_IMAGE
    model_timeout: Annotated[float, Field(gt=0, description="Seconds one model request may take before it is "
                                                            "retried."), flag("--model-timeout")] = DEFAULT_MODEL_TIMEOUT_S
    price_input: Annotated[float | None, Field(ge=0, description="US dollars per million prompt tokens, for the cost "
                                                                 "shown (where the server reports none).")] = None
    price_output: Annotated[float | None, Field(ge=0, description="US dollars per million completion tokens.")] = None


class RunFile(RunKeys):
    """The config file's keys: all optional, strictly typed, no others."""

    model_config = ConfigDict(extra="forbid", strict=True)

    expose: list[str] = Field(default_factory=list)


def config_path() -> Path:
    root = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(root) / "tmax" / "config.toml"


def data_dir() -> Path:
    root = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(root) / "tmax"


def default_run_dir() -> Path:
    # Microseconds keep two runs started in the same second apart.
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return data_dir() / "runs" / stamp


def env_vars(key: str) -> tuple[str, ...]:
    """The variables a setting of `tmax run` is read from, in order."""
    return env_names((key,), RunKeys.model_fields[key], ENV_PREFIX)


def _file_source(path: Path) -> dict[str, Any]:
    """The config file's settings ({} when there is no file), validated strictly (TOML has
    types: `max_steps = "ten"` or `= true` is a mistake worth naming); bad content is a
    ConfigError naming the file."""
    if not path.exists():
        return {}
    data = read_toml(path)
    try:
        # Under the settings' current names: an old agent-setting name is read as the new one.
        return RunFile.model_validate(data).model_dump(exclude_unset=True)
    except ValidationError as e:
        raise ConfigError(f"config file {path}: {_first_problem(e)}") from None


def load_file(path: Path | None = None) -> dict[str, Any]:
    return _file_source(path or config_path())


def _first_problem(e: ValidationError) -> str:
    if not e.errors()[0]["loc"]:  # a whole-file problem (an old and a new name given together)
        return validation_message(e)
    err = e.errors()[0]
    key = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown key {key!r} (allowed: {', '.join(RunFile.model_fields)})"
    return f"{key}: {err['msg']}, got {type(err['input']).__name__} {err['input']!r}"


@dataclass
class RunSettings:
    base_url: str | None  # None only where it was not needed (--print-config)
    model: str | None  # None: ask the server (a single served model is used)
    api_key: str
    sandbox: str
    mode: str
    image: str
    # Every agent setting: as a flag, variable or the file set it, else Vanillux2's default
    # (max_tokens is fitted to what the server's window leaves).
    agent: AgentSettings = field(default_factory=AgentSettings)
    model_timeout: float = DEFAULT_MODEL_TIMEOUT_S
    expose: list[str] = field(default_factory=list)  # host paths the bwrap jail does not mask
    # US dollars per million prompt and completion tokens (None: only what the server reports).
    prices: tuple[float, float] | None = None
    # Setting name -> where its value came from ("--base-url", "$OPENAI_BASE_URL", file path, "default").
    sources: dict[str, str] = field(default_factory=dict)

    def shown(self) -> dict[str, Any]:
        """Every setting by its key, for `--print-config`."""
        own = {k: getattr(self, k) for k in ("base_url", "model", "api_key", "sandbox", "mode", "image",
                                             "model_timeout", "expose")}
        prices = dict(zip(("price_input", "price_output"), self.prices or (None, None)))
        return {**own, **prices, **self.agent.model_dump()}


def missing_setting_message(what: str, flag: str, env: tuple[str, ...], path: Path, key: str) -> str:
    envs = " / ".join(f"${e}" for e in env)
    return (
        f"no {what} given. Set one of: the {flag} flag, the environment variable {envs}, "
        f"or `{key} = \"...\"` in the config file {path}."
    )


def _merge(flags: dict[str, Any], labels: dict[str, str], path: Path) -> tuple[dict[str, Any], dict[str, str], list]:
    """The merged settings (file, then environment, then flags), where each came from, and
    the file's `expose` list."""
    file = _file_source(path)
    expose = file.pop("expose", [])
    env, env_labels = env_layer(RunKeys, ENV_PREFIX)
    data, sources = resolve_layers([(file, str(path)), (env, env_labels), (flags, labels)])
    try:
        merged = RunKeys.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        raise ConfigError(f"{key}: {err['msg']}, got {err['input']!r} (from {sources.get(key, 'default')})") from None
    return merged.model_dump(), sources, expose


def resolve_run_settings(*, path: Path | None = None, expose: list[str] | None = None,
                         labels: dict[str, str] | None = None, need_base_url: bool = True, **flags: Any) -> RunSettings:
    """Merge flags, environment and config file; raise ConfigError naming every source tried.
    `flags`: the RunKeys settings as given on the command line (None: not given); `labels`:
    the flag each came from (default: the setting's declared flag). `need_base_url=False`
    (--print-config): a missing base URL is shown as unset rather than refused."""
    path = path or config_path()
    unknown = set(flags) - set(RunKeys.model_fields)
    if unknown:
        raise TypeError(f"resolve_run_settings: unknown settings {sorted(unknown)}")
    declared = {spec.paths[0][0]: spec.name for spec in flag_specs(RunKeys, "run")}
    given = {k: v for k, v in flags.items() if v is not None}
    s, sources, file_expose = _merge(given, {k: (labels or {}).get(k) or declared.get(k, k) for k in given}, path)
    if not s["base_url"] and need_base_url:
        raise ConfigError(missing_setting_message("base URL", "--base-url", env_vars("base_url"), path, "base_url"))
    if s["base_url"] and not s["base_url"].startswith(("http://", "https://")):
        raise ConfigError(f"base URL {s['base_url']!r} (from {sources['base_url']}) must start with http:// or https://")
    if s["sandbox"] is None:
        s["sandbox"], sources["sandbox"] = default_sandbox(), "default (bwrap where it works)"
    if s["mode"] is None:
        # People watch what runs on their own machine; isolated sandboxes run freely.
        s["mode"], sources["mode"] = ("confirm" if s["sandbox"] == "local" else "yolo"), "default (from the sandbox)"
    agent = {k: v for k in AgentSettings.model_fields if (v := s.pop(k)) is not None}
    if "compaction" not in agent:  # off for bench and learn (the protocol), on for people
        agent["compaction"], sources["compaction"] = True, "default (tmax run)"
    price_in, price_out = s.pop("price_input"), s.pop("price_output")
    prices = None if price_in is None and price_out is None else (price_in or 0.0, price_out or 0.0)
    for key in RunKeys.model_fields:
        sources.setdefault(key, "default")
    s["base_url"] = s["base_url"].rstrip("/") if s["base_url"] else None
    shown = list(file_expose) + list(expose or [])
    return RunSettings(**s, agent=AgentSettings.model_validate(agent), expose=shown, prices=prices, sources=sources)


_bwrap_ok: bool | None = None


def bwrap_works() -> bool:
    """bubblewrap is installed *and* can create its namespaces here (some containers forbid it)."""
    global _bwrap_ok
    if _bwrap_ok is None:
        exe = shutil.which("bwrap")
        if exe is None:
            _bwrap_ok = False
        else:
            try:
                probe = subprocess.run(
                    [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net", "true"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=10,
                )
                _bwrap_ok = probe.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                _bwrap_ok = False
    return _bwrap_ok


def default_sandbox() -> str:
    return "bwrap" if bwrap_works() else "local"
