"""The settings of a `tmax bench` job, declared once: their flags, help, defaults, the keys of
a `--config FILE` and the `TMAX_BENCH_<KEY>` variables all come from `BenchSettings`.

A config file has the settings' keys (the long flags with underscores: `n_attempts` for
`--n-attempts`, `env` for `--env`, ...), the dataset, and every agent setting
(`agents.agent_settings`, what `--ak KEY=VALUE` sets), all flat and all optional:

    dataset = "../shared/tb2-sample"   # PATH or name@version, as the argument
    agent = "tmax"
    model = "Qwen/Qwen3-8B"
    n_attempts = 5
    include = ["fix-*"]
    max_steps = 32                     # agent settings, as --ak max_steps=32

Where a value comes from, later wins (`common.settings.resolve_layers`): the command's own
defaults (`terminal-bench`'s protocol), the file, the environment (`TMAX_BENCH_<KEY>`, and
`TMAX_BASE_URL` for the endpoint), the flags, then `--ak`. Paths are read as the flags read
them, from the current directory. The file is validated strictly: an unknown key or a value
of the wrong type is an error naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Mapping

from pydantic import ConfigDict, Field, ValidationError

from tmax.agents.agent_settings import RENAMED, AgentSettings, AgentSettingsPatch
from tmax.common.errors import ConfigError, validation_message
from tmax.common.files import read_toml
from tmax.common.settings import Env, env_layer, flag, resolve_layers
from tmax.sandbox.base import SandboxKind

ENV_PREFIX = "TMAX_BENCH_"
# The commands that start a job, and those that also read tasks (prepare builds their images).
JOB = ("bench run", "bench terminal-bench")
TASKS = (*JOB, "bench prepare")
# `tmax bench terminal-bench`: the paper's protocol, on top of the declared defaults.
TERMINAL_BENCH = {"dataset": "terminal-bench@2.0", "agent": "tmax", "n_attempts": 5, "n_concurrent": 4,
                  "timeout_multiplier": 1.0}


class BenchSettings(AgentSettingsPatch):  # type: ignore[misc,valid-type]
    """A job's settings (see the module doc) and, none set by default, the agent's."""

    model_config = ConfigDict(extra="forbid")

    dataset: Annotated[str | None, Field(description="Dataset name or directory."),
                       flag("--dataset", "-d", commands=("bench terminal-bench",))] = None
    agent: Annotated[str, Field(description="A harness (tmax | mini-swe | terminus-2), oracle or nop."),
                     flag("--agent", "-a", commands=JOB)] = "oracle"
    model: Annotated[str | None, Field(description="Model name at the endpoint (tmax agent)."),
                     flag("--model", "-m", commands=JOB)] = None
    base_url: Annotated[str | None, Field(description="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 "
                                                      "(not part of the job identity)."),
                        flag("--base-url", commands=JOB), Env(("TMAX_BASE_URL",))] = None
    api_key_env: Annotated[str, Field(description="Environment variable holding the API key."),
                           flag("--api-key-env", commands=JOB)] = "OPENAI_API_KEY"
    n_attempts: Annotated[int, Field(ge=1, description="Attempts per task (pass@k)."),
                          flag("--n-attempts", "-k", commands=("bench run",))] = 1
    n_concurrent: Annotated[int, Field(ge=1, description="Trials run at once."),
                            flag("--n-concurrent", "-n", commands=JOB)] = 1
    include: Annotated[list[str], Field(default_factory=list, description="Only tasks matching this glob "
                                                                          "(repeatable)."), flag("--include", "-i", commands=TASKS)]
    exclude: Annotated[list[str], Field(default_factory=list, description="Skip tasks matching this glob "
                                                                          "(repeatable)."), flag("--exclude", "-x", commands=TASKS)]
    n_tasks: Annotated[int | None, Field(ge=0, description="At most this many tasks (after -i/-x)."),
                       flag("--n-tasks", "-l", commands=TASKS)] = None
    jobs_dir: Annotated[str, Field(description="Where job directories go."),
                        flag("--jobs-dir", "-o", commands=JOB)] = "jobs"
    job_name: Annotated[str | None, Field(description="Job directory name (unset: a timestamp). Reusing one resumes it."),
                        flag("--job-name", commands=JOB)] = None
    timeout_multiplier: Annotated[float, Field(ge=0.01, description="Scale the agent and verifier timeouts."),
                                  flag("--timeout-multiplier", commands=("bench run",))] = 1.0
    image_map: Annotated[list[str], Field(default_factory=list, description="Re-target a base image: FROM=TO (FROM "
                                                                            "may be a glob; repeatable)."),
                         flag("--image-map", commands=TASKS)]
    prebuilt: Annotated[bool, Field(description="Use a task's docker_image when it can be pulled."),
                        flag("--prebuilt", commands=TASKS)] = True
    retry_infra: Annotated[bool, Field(description="Rerun trials that ended in an infrastructure error."),
                           flag("--retry-infra", commands=JOB)] = False
    env: Annotated[SandboxKind, Field(description="Where trials run: podman (task images), or bwrap / local (the "
                                                  "host stands in for the base image; only for tasks whose Dockerfile "
                                                  "is FROM + WORKDIR + COPY/ADD + ENV)."),
                   flag("--env", "-e", commands=JOB)] = "podman"
    warm_ahead: Annotated[int, Field(ge=0, description="podman: containers started ahead for the trials next in line "
                                                       "(worth it when container starts are long against the trials)."),
                          flag("--warm-ahead", commands=JOB)] = 0
    overlay: Annotated[bool, Field(description="podman: each trial a fresh overlay of a container its task's trials "
                                               "share, or a fresh container per trial."),
                       flag("--overlay/--fresh-containers", commands=JOB)] = True

    def agent_settings(self) -> dict[str, Any]:
        """The agent settings some source set (the job's `agent_kwargs`)."""
        return {k: v for k in AgentSettings.model_fields if (v := getattr(self, k)) is not None}


def load_bench_file(path: Path) -> BenchSettings:
    """The file's settings; ConfigError, in one line naming the file, for anything wrong."""
    data = read_toml(path)
    try:
        return BenchSettings.model_validate(data, strict=True)
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e, 'key', BenchSettings.model_fields)}") from None


def _agent_settings(given: dict[str, Any]) -> dict[str, Any]:
    """`--ak`'s settings, checked as agent settings (not job settings) and under their new names."""
    try:
        checked = AgentSettings.from_settings(given)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return checked.model_dump(include={RENAMED.get(k, k) for k in given})


def resolve_bench(file: Path | None, flags: tuple[dict, Mapping[str, str]], agent_flags: dict[str, Any],
                  command_defaults: Mapping[str, Any] | None = None) -> tuple[BenchSettings, dict[str, str]]:
    """A job's settings and where each came from: `command_defaults`, the file, the
    environment, the flags (a `cli.options.FlagValues` layer), then `--ak`'s agent settings."""
    layers: list[tuple[Mapping, Any]] = [(dict(command_defaults or {}), "the command's default")]
    if file is not None:
        layers.append((load_bench_file(file).model_dump(exclude_unset=True), str(file)))
    layers += [env_layer(BenchSettings, ENV_PREFIX), flags, (_agent_settings(agent_flags), "--ak")]
    data, sources = resolve_layers(layers)
    try:
        return BenchSettings.model_validate(data), sources
    except ValidationError as e:
        raise ConfigError(validation_message(e, "setting", BenchSettings.model_fields)) from None
