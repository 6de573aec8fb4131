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
    max_steps = 64
    max_tokens = 16384         # per model turn; fitted to what the server's window leaves
    command_timeout = 120      # seconds per command
    model_timeout = 600        # seconds per model request
    expose = ["~/.ssh"]        # credential paths the bwrap jail may show (masked otherwise)

The file is validated by a pydantic model: an unknown key or a wrong type is an error
naming the key and the file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.policy import DEFAULT_MODEL_TIMEOUT_S
from sandbox.base import DEFAULT_COMMAND_TIMEOUT_S, KINDS as SANDBOX_KINDS
from training.config import ConfigError

MODES = ("confirm", "yolo")
DEFAULT_IMAGE = "localhost/tmax-base:bookworm"

# Checked in this order; the first one set wins.
BASE_URL_ENV = ("TMAX_BASE_URL", "OPENAI_BASE_URL")
API_KEY_ENV = ("TMAX_API_KEY", "OPENAI_API_KEY")
MODEL_ENV = ("TMAX_MODEL",)
COMMAND_TIMEOUT_ENV = ("TMAX_COMMAND_TIMEOUT",)
MODEL_TIMEOUT_ENV = ("TMAX_MODEL_TIMEOUT",)



class RunFile(BaseModel):
    """The config file's keys: all optional, strictly typed, no others."""

    model_config = ConfigDict(extra="forbid", strict=True)

    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    sandbox: Literal[SANDBOX_KINDS] | None = None  # type: ignore[valid-type]
    mode: Literal[MODES] | None = None  # type: ignore[valid-type]
    image: str | None = None
    max_steps: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    command_timeout: float | None = Field(None, gt=0)
    model_timeout: float | None = Field(None, gt=0)
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


def load_file(path: Path | None = None) -> dict[str, Any]:
    """The config file's settings ({} when there is no file); bad content is a ConfigError."""
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    try:
        RunFile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"config file {path}: {_first_problem(e)}") from None
    return data


def _first_problem(e: ValidationError) -> str:
    err = e.errors()[0]
    key = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown key {key!r} (allowed: {', '.join(RunFile.model_fields)})"
    return f"{key}: {err['msg']}, got {type(err['input']).__name__} {err['input']!r}"


def _from_env(names: tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value, f"${name}"
    return None, None


@dataclass
class RunSettings:
    base_url: str
    model: str | None  # None: ask the server (a single served model is used)
    api_key: str
    sandbox: str
    mode: str
    image: str
    max_steps: int | None
    max_tokens: int | None = None  # None: the Vanillux2 16,384, fitted to the server's window
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S
    model_timeout: float = DEFAULT_MODEL_TIMEOUT_S
    expose: list[str] = field(default_factory=list)  # host paths the bwrap jail does not mask
    # Setting name -> where its value came from ("--base-url", "$OPENAI_BASE_URL", file path, "default").
    sources: dict[str, str] = field(default_factory=dict)


def _pick(flag_value: Any, flag_name: str, env: tuple[str, ...] | None, key: str, file: dict, path: Path):
    if flag_value is not None:
        return flag_value, flag_name
    if env:
        value, src = _from_env(env)
        if value is not None:
            return value, src
    if key in file:
        return file[key], str(path)
    return None, None


def missing_setting_message(what: str, flag: str, env: tuple[str, ...], path: Path, key: str) -> str:
    envs = " / ".join(f"${e}" for e in env)
    return (
        f"no {what} given. Set one of: the {flag} flag, the environment variable {envs}, "
        f"or `{key} = \"...\"` in the config file {path}."
    )


def resolve_run_settings(
    *,
    base_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    sandbox: str | None = None,
    mode: str | None = None,
    image: str | None = None,
    max_steps: int | None = None,
    max_tokens: int | None = None,
    command_timeout: float | None = None,
    model_timeout: float | None = None,
    expose: list[str] | None = None,
    path: Path | None = None,
) -> RunSettings:
    """Merge flags, environment and config file; raise ConfigError naming every source tried."""
    path = path or config_path()
    file = load_file(path)
    sources: dict[str, str] = {}

    url, sources["base_url"] = _pick(base_url, "--base-url", BASE_URL_ENV, "base_url", file, path)
    if not url:
        raise ConfigError(missing_setting_message("base URL", "--base-url", BASE_URL_ENV, path, "base_url"))
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"base URL {url!r} (from {sources['base_url']}) must start with http:// or https://")

    name, sources["model"] = _pick(model, "--model", MODEL_ENV, "model", file, path)
    key, sources["api_key"] = _pick(api_key, "--api-key", API_KEY_ENV, "api_key", file, path)
    if key is None:
        # Local OpenAI-compatible servers (vLLM) accept any key; the client needs a string.
        key, sources["api_key"] = "EMPTY", "default"

    kind, sources["sandbox"] = _pick(sandbox, "--sandbox", None, "sandbox", file, path)
    if kind is None:
        kind, sources["sandbox"] = default_sandbox(), "default"
    if kind not in SANDBOX_KINDS:
        raise ConfigError(f"sandbox {kind!r} (from {sources['sandbox']}) is not one of {', '.join(SANDBOX_KINDS)}")

    approval, sources["mode"] = _pick(mode, "--mode", None, "mode", file, path)
    if approval is None:
        # People watch what runs on their own machine; isolated sandboxes run freely.
        approval, sources["mode"] = ("confirm" if kind == "local" else "yolo"), "default"
    if approval not in MODES:
        raise ConfigError(f"mode {approval!r} (from {sources['mode']}) is not one of {', '.join(MODES)}")

    img, sources["image"] = _pick(image, "--image", None, "image", file, path)
    if img is None:
        img, sources["image"] = DEFAULT_IMAGE, "default"

    steps, sources["max_steps"] = _pick(max_steps, "--max-steps", None, "max_steps", file, path)
    if steps is not None and steps < 1:
        raise ConfigError(f"max_steps must be at least 1, got {steps} (from {sources['max_steps']})")

    tokens, sources["max_tokens"] = _pick(max_tokens, "--max-tokens", None, "max_tokens", file, path)
    if tokens is not None and tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {tokens} (from {sources['max_tokens']})")
    cmd_s = _seconds(command_timeout, "--command-timeout", COMMAND_TIMEOUT_ENV, "command_timeout", file, path, sources)
    model_s = _seconds(model_timeout, "--model-timeout", MODEL_TIMEOUT_ENV, "model_timeout", file, path, sources)
    shown = list(file.get("expose", [])) + list(expose or [])

    return RunSettings(
        base_url=url.rstrip("/"),
        model=name,
        api_key=key,
        sandbox=kind,
        mode=approval,
        image=img,
        max_steps=steps,
        max_tokens=tokens,
        command_timeout=cmd_s if cmd_s is not None else DEFAULT_COMMAND_TIMEOUT_S,
        model_timeout=model_s if model_s is not None else DEFAULT_MODEL_TIMEOUT_S,
        expose=shown,
        sources=sources,
    )


def _seconds(flag_value: float | None, flag: str, env: tuple[str, ...], key: str, file: dict, path: Path,
             sources: dict[str, str]) -> float | None:
    """A positive number of seconds from flag, environment or file (None: the default)."""
    value, sources[key] = _pick(flag_value, flag, env, key, file, path)
    if value is None:
        sources[key] = "default"
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{key} must be a number of seconds, got {value!r} (from {sources[key]})") from None
    if not seconds > 0:
        raise ConfigError(f"{key} must be more than 0 seconds, got {value!r} (from {sources[key]})")
    return seconds


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
