"""Where `tmax run` gets its settings: command-line flags first, then environment
variables, then the user's config file, then built-in defaults.

The config file is TOML at `$XDG_CONFIG_HOME/tmax/config.toml` (`~/.config/tmax/config.toml`
when XDG_CONFIG_HOME is unset), with flat keys:

    base_url = "http://localhost:8000/v1"
    model = "allenai/tmax-9b"
    api_key = "..."            # optional; local servers usually need none
    sandbox = "bwrap"          # local | bwrap | podman
    mode = "confirm"           # confirm | yolo
    image = "localhost/tmax-base:bookworm"
    model_timeout = 600        # seconds per model request
    expose = ["~/.ssh"]        # credential paths the bwrap jail may show (masked otherwise)
    price_input = 3.0          # US dollars per million prompt tokens, for the cost shown
    price_output = 15.0        # ... and per million completion tokens (where the server reports none)
    # and any agent setting (`agents.settings`, the names bench and learn use), e.g.
    max_steps = 64
    max_tokens = 16384         # per model turn; fitted to what the server's window leaves
    command_timeout = 120      # seconds per command
    temperature = 0.7
    compaction = true          # on in `tmax run` (the agent settings' default is off)
    compaction_threshold = 0.8 # the share of the context window that sets compaction off

The file is validated by a pydantic model: an unknown key or a wrong type is an error
naming the key and the file. The precedence is pydantic-settings' (`RunSources`): the
flags are its init values, then the documented environment variables, then the file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from tmax.agents.policy import DEFAULT_MODEL_TIMEOUT_S
from tmax.agents.settings import AgentSettings, AgentSettingsPatch
from tmax.sandbox.base import KINDS as SANDBOX_KINDS
from tmax.common.errors import ConfigError, validation_message

MODES = ("confirm", "yolo")
DEFAULT_IMAGE = "localhost/tmax-base:bookworm"

# Checked in this order; the first one set wins.
BASE_URL_ENV = ("TMAX_BASE_URL", "OPENAI_BASE_URL")
API_KEY_ENV = ("TMAX_API_KEY", "OPENAI_API_KEY")
MODEL_ENV = ("TMAX_MODEL",)
COMMAND_TIMEOUT_ENV = ("TMAX_COMMAND_TIMEOUT",)
MODEL_TIMEOUT_ENV = ("TMAX_MODEL_TIMEOUT",)



class RunKeys(AgentSettingsPatch):  # type: ignore[misc,valid-type]
    """The settings of `tmax run` that a flag, a variable or the config file can set: its
    own, and every agent setting (`agents.settings`), each None where no source sets it."""

    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    sandbox: Literal[SANDBOX_KINDS] | None = None  # type: ignore[valid-type]
    mode: Literal[MODES] | None = None  # type: ignore[valid-type]
    image: str | None = None
    model_timeout: float | None = Field(None, gt=0)
    price_input: float | None = Field(None, ge=0)  # US dollars per million prompt tokens
    price_output: float | None = Field(None, ge=0)  # ... per million completion tokens


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


def _file_source(path: Path) -> dict[str, Any]:
    """The config file's settings ({} when there is no file), validated strictly (TOML has
    types: `max_steps = "ten"` or `= true` is a mistake worth naming); bad content is a
    ConfigError naming the file."""
    if not path.exists():
        return {}
    try:
        data = TomlConfigSettingsSource(RunSources, toml_file=path)()
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
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


# Environment variables per setting, checked in this order; the first one set wins.
ENV_NAMES = {"base_url": BASE_URL_ENV, "api_key": API_KEY_ENV, "model": MODEL_ENV,
             "command_timeout": COMMAND_TIMEOUT_ENV, "model_timeout": MODEL_TIMEOUT_ENV}
FLAGS = {"base_url": "--base-url", "model": "--model", "api_key": "--api-key", "sandbox": "--sandbox", "mode": "--mode",
         "image": "--image", "max_steps": "--max-steps", "max_tokens": "--max-tokens",
         "command_timeout": "--command-timeout", "model_timeout": "--model-timeout", "budget_hints": "--budget-hints",
         "compaction": "--no-compact", "compaction_threshold": "--compact-threshold"}


class NamedEnvSource(PydanticBaseSettingsSource):
    """Exactly the documented variables (`ENV_NAMES`), not one per field: a stray $MODEL or
    $SANDBOX in someone's shell must not change a run."""

    def found(self) -> dict[str, tuple[str, str]]:
        """setting -> (value, variable it came from)."""
        out = {}
        for key, names in ENV_NAMES.items():
            name = next((n for n in names if os.environ.get(n)), None)
            if name is not None:
                out[key] = (os.environ[name], name)
        return out

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        value, name = self.found().get(field_name, (None, ""))
        return value, name, False

    def __call__(self) -> dict[str, Any]:
        return {key: value for key, (value, _) in self.found().items()}


class RunSources(BaseSettings, RunKeys):
    """Flag > environment > config file, merged by pydantic-settings (`settings_customise_sources`);
    None where no source sets a value (the defaults depend on each other: see resolve_run_settings).
    `expose` is not here: the file's list and the flags' add up."""

    model_config = SettingsConfigDict(extra="ignore")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        file = _CONFIG_FILE.get()
        return (init_settings, NamedEnvSource(settings_cls),
                *([TomlConfigSettingsSource(settings_cls, toml_file=file)] if file is not None else []))


_CONFIG_FILE: ContextVar[Path | None] = ContextVar("tmax_config_file", default=None)


@dataclass
class RunSettings:
    base_url: str
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


def missing_setting_message(what: str, flag: str, env: tuple[str, ...], path: Path, key: str) -> str:
    envs = " / ".join(f"${e}" for e in env)
    return (
        f"no {what} given. Set one of: the {flag} flag, the environment variable {envs}, "
        f"or `{key} = \"...\"` in the config file {path}."
    )


def _merge(flags: dict[str, Any], path: Path) -> tuple[RunSources, dict[str, str]]:
    """The merged settings and where each came from."""
    file = _file_source(path)
    env = NamedEnvSource(RunSources).found()
    sources = {k: FLAGS[k] for k in flags}
    sources.update({k: f"${name}" for k, (_, name) in env.items() if k not in sources})
    sources.update({k: str(path) for k in file if k not in sources and k in RunSources.model_fields})
    token = _CONFIG_FILE.set(path if file else None)
    try:
        return RunSources(**flags), sources
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0])
        raise ConfigError(f"{key}: {err['msg']}, got {err['input']!r} (from {sources.get(key, 'default')})") from None
    finally:
        _CONFIG_FILE.reset(token)


def resolve_run_settings(*, path: Path | None = None, expose: list[str] | None = None, **flags: Any) -> RunSettings:
    """Merge flags, environment and config file; raise ConfigError naming every source tried.
    `flags`: the RunSources fields as given on the command line (None: not given)."""
    path = path or config_path()
    unknown = set(flags) - set(RunSources.model_fields)
    if unknown:
        raise TypeError(f"resolve_run_settings: unknown settings {sorted(unknown)}")
    merged, sources = _merge({k: v for k, v in flags.items() if v is not None}, path)
    s = merged.model_dump()
    if not s["base_url"]:
        raise ConfigError(missing_setting_message("base URL", "--base-url", BASE_URL_ENV, path, "base_url"))
    if not s["base_url"].startswith(("http://", "https://")):
        raise ConfigError(f"base URL {s['base_url']!r} (from {sources['base_url']}) must start with http:// or https://")
    # Local OpenAI-compatible servers (vLLM) accept any key; the client needs a string.
    defaults = {"api_key": "EMPTY", "sandbox": default_sandbox, "image": DEFAULT_IMAGE,
                "model_timeout": DEFAULT_MODEL_TIMEOUT_S}
    for key, default in defaults.items():
        if s[key] is None:
            s[key], sources[key] = default() if callable(default) else default, "default"
    if s["mode"] is None:
        # People watch what runs on their own machine; isolated sandboxes run freely.
        s["mode"], sources["mode"] = ("confirm" if s["sandbox"] == "local" else "yolo"), "default"
    given = {k: v for k in AgentSettings.model_fields if (v := s.pop(k)) is not None}
    if "compaction" not in given:  # off for bench and learn (the protocol), on for people
        given["compaction"], sources["compaction"] = True, "default (tmax run)"
    price_in, price_out = s.pop("price_input"), s.pop("price_output")
    prices = None if price_in is None and price_out is None else (price_in or 0.0, price_out or 0.0)
    for key in ("model", *AgentSettings.model_fields):
        sources.setdefault(key, "default")
    s["base_url"] = s["base_url"].rstrip("/")
    shown = list(_file_source(path).get("expose", [])) + list(expose or [])
    return RunSettings(**s, agent=AgentSettings.model_validate(given), expose=shown, prices=prices, sources=sources)


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
