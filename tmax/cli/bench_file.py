"""`tmax bench run --config FILE`: a job's settings in a TOML file, flags on top.

The keys are the long flags of `tmax bench run` with underscores (`n_attempts` for
`--n-attempts`, `n_tasks` for `--n-tasks`, `env` for `--env`, ...), the dataset, and every
agent setting (`agents.settings`, what `--ak KEY=VALUE` sets), all flat and all optional:

    dataset = "../shared/tb2-sample"   # PATH or name@version, as the argument
    agent = "tmax"
    model = "Qwen/Qwen3-8B"
    base_url = "http://127.0.0.1:8000/v1"
    n_attempts = 5
    n_concurrent = 4
    include = ["fix-*"]
    env = "podman"
    max_steps = 32                     # agent settings, as --ak max_steps=32
    temperature = 0.6

A flag given on the command line wins over the file, the file over the environment
($TMAX_BASE_URL) and the defaults; `--ak` settings win over the file's agent settings one by
one. Paths are read as the flags read them, from the current directory. The file is
validated strictly: an unknown key or a value of the wrong type is an error naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import typer
from pydantic import ConfigDict, Field, ValidationError

from tmax.agents.settings import AgentSettings, AgentSettingsPatch
from tmax.common.errors import ConfigError, validation_message
from tmax.common.files import read_toml
from tmax.sandbox.base import KINDS


class BenchFile(AgentSettingsPatch):  # type: ignore[misc,valid-type]
    """The keys of a `tmax bench run --config` file (see the module doc)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset: str | None = None
    agent: str | None = None
    model: str | None = None
    base_url: str | None = None
    api_key_env: str | None = None
    n_attempts: int | None = Field(None, ge=1)
    n_concurrent: int | None = Field(None, ge=1)
    include: list[str] | None = None
    exclude: list[str] | None = None
    n_tasks: int | None = Field(None, ge=0)
    jobs_dir: str | None = None
    job_name: str | None = None
    timeout_multiplier: float | None = Field(None, ge=0.01)
    image_map: list[str] | None = None
    prebuilt: bool | None = None
    retry_infra: bool | None = None
    env: Literal[KINDS] | None = None  # type: ignore[valid-type]
    warm_ahead: int | None = Field(None, ge=0)
    overlay: bool | None = None


def load_bench_file(path: Path) -> BenchFile:
    """The file's settings; ConfigError, in one line naming the file, for anything wrong."""
    data = read_toml(path)
    try:
        return BenchFile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e, 'key', BenchFile.model_fields)}") from None


def with_file(ctx: typer.Context, path: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The command's parameters (`ctx.params`) with the file's settings where no flag was
    given on the command line, and the file's agent settings apart (`--ak` goes on top)."""
    values = dict(ctx.params)
    if path is None:
        return values, {}
    given = load_bench_file(path).model_dump(exclude_unset=True)
    agent = {k: given.pop(k) for k in list(given) if k in AgentSettings.model_fields}
    for key, value in given.items():
        source = ctx.get_parameter_source(key)  # typer's own click: compared by name
        if source is None or source.name != "COMMANDLINE":
            values[key] = Path(value) if key == "jobs_dir" else value
    return values, agent
