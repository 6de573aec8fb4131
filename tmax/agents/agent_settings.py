"""The agent's settings: one schema, the same key names wherever they are set.

    max_steps, max_tokens, context_budget, temperature, top_p, command_timeout,
    max_format_errors, observation_max_chars, retries, backoff_s, budget_hints,
    time_budget_s, compaction, compaction_threshold

each declared once below with its type, default and help (`Annotated[..., Field(description=...)]`);
the docs' tables and `--print-config` show them.

Where they are set, under these names:

* `tmax run`: its config file (`~/.config/tmax/config.toml`, flat keys), `TMAX_<KEY>` and its
  flags (those a `flag(..., commands=("run",))` names; `tmax.cli.run_settings`);
* `tmax bench run`: `--ak KEY=VALUE`, and `--config FILE` (flat keys beside the job's);
* `tmax learn`: the `[rollout]` section, whose model (`training.config.RolloutConfig`)
  extends this one with the training-only keys.

Defaults. This model's are Vanillux2's, the protocol `tmax run` and `tmax bench` follow. The
training recipe differs on purpose, and `RolloutConfig` declares its own defaults for
temperature and top_p (sample the policy itself), max_format_errors (the first turn without
a valid call ends an episode), context_budget (prompt + response budget), retries and
backoff_s (a failing engine is an infrastructure error: the episode is re-queued rather than
waited for).

Renamed keys (`RENAMED`): the learn config's `max_tool_calls` is `max_steps` and
`per_turn_max_tokens` is `max_tokens`. An old name still loads, with a `RenamedSettingWarning`
naming the new one; the old and the new name together are an error.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

from tmax.agents.observation import ObservationLimits
from tmax.common.errors import RenamedSettingWarning, validation_message
from tmax.common.settings import DECLARED_DEFAULT, flag
from tmax.sandbox.base import DEFAULT_COMMAND_TIMEOUT_S

# old name -> new name
RENAMED = {"max_tool_calls": "max_steps", "per_turn_max_tokens": "max_tokens"}

# The types of the settings, constraints included, for models that declare other defaults.
Count = Annotated[int, Field(ge=1)]
Fraction = Annotated[float, Field(gt=0, lt=1)]
Seconds = Annotated[float, Field(gt=0)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
Chars = Annotated[int, Field(ge=100)]
# A list in TOML and JSON: accepted for the tuple even where the rest is strict.
Backoff = Annotated[tuple[NonNegativeFloat, ...], Field(strict=False)]


def renamed_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with every old key name (`RENAMED`) replaced by the new one, and a warning for
    each; ValueError where both names are given."""
    out = dict(data)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"'{old}' is the old name of '{new}': give only '{new}'")
        warnings.warn(f"agent setting '{old}' is now called '{new}'; the old name still loads for now, "
                      f"write '{new}'", RenamedSettingWarning, stacklevel=2)
        out[new] = out.pop(old)
    return out


class _NewNames(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data) if isinstance(data, Mapping) else data


class AgentSettings(_NewNames):
    """The settings of `agents.loop.Agent`, with Vanillux2's defaults (see the module doc).
    Sampling settings are applied by whoever builds the policy (ChatPolicy / TokenPolicy)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # The flags are `tmax run`'s; bench sets these with `--ak KEY=VALUE`, learn in `[rollout]`.
    max_steps: Annotated[Count, Field(description="Model turns per episode, format errors included."),
                         flag("--max-steps", commands=("run",))] = 64
    command_timeout: Annotated[Seconds, Field(description="Seconds a command may run before it is stopped."),
                               flag("--command-timeout", commands=("run",))] = DEFAULT_COMMAND_TIMEOUT_S
    max_format_errors: Annotated[Count, Field(description="Turns in a row without a valid action that end the "
                                                          "episode.")] = 64
    temperature: Annotated[Temperature, Field(description="Sampling temperature.")] = 0.7
    top_p: Annotated[TopP, Field(description="Nucleus sampling's top-p.")] = 0.95
    max_tokens: Annotated[Count, Field(description="Most tokens per model turn (lowered to what the server's "
                                                   "context window leaves)."), flag("--max-tokens", commands=("run",))] = 16384
    # For servers whose window is larger than the budget (a smaller window raises
    # ContextOverflow itself).
    context_budget: Annotated[Count, Field(description="Prompt + completion tokens of a turn after which the "
                                                       "episode stops.")] = 65536
    observation_max_chars: Annotated[Chars, Field(description="What the model sees of a command's output, in "
                                                              "characters (head and tail).")] = 10000
    retries: Annotated[Count, Field(description="Attempts at a model call.")] = 5
    backoff_s: Annotated[Backoff, Field(description="Seconds waited between the attempts.")] = (2, 4, 8, 16)
    # Opt-in (agents.budget): observations end with the steps, time and context left.
    budget_hints: Annotated[bool, Field(description="Append the steps, time and context left to each observation."),
                            flag("--budget-hints", commands=("run",))] = False
    time_budget_s: Annotated[Seconds | None, Field(description="The time budget budget hints show (unset: no "
                                                               "limit; bench: the agent timeout).")] = None
    # Opt-in (agents.compaction), so bench and learn keep the Vanillux2 protocol: once a
    # turn's context reaches this share of the window, the model summarises the session.
    compaction: Annotated[bool, Field(description="Summarise the session when its context nears the window."), flag(
        "--compact", commands=("run",), help="Summarise the session when its context nears the window (on by default "
                                             "in tmax run).")] = False
    compaction_threshold: Annotated[Fraction, Field(description="The share of the context window that sets compaction "
                                                                "off, in (0, 1)."),
                                    flag("--compact-threshold", commands=("run",))] = 0.8

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> AgentSettings:
        """The one way agent settings are made from a mapping (bench's `--ak` and `--config`,
        a job's stored settings): a value None keeps its default. ValueError, in one line,
        for a name that is not a setting or a value that does not fit."""
        try:
            return cls.model_validate({k: v for k, v in settings.items() if v is not None})
        except ValidationError as e:
            raise ValueError(validation_message(e, "agent setting", cls.model_fields)) from None

    def agent_only(self) -> AgentSettings:
        """These settings as a plain AgentSettings (the other keys of a subclass, such as
        the learn config's training-only rollout keys, left out)."""
        return AgentSettings.model_validate(self.model_dump(include=set(AgentSettings.model_fields)))

    @property
    def observation_limits(self) -> ObservationLimits:
        half = self.observation_max_chars // 2
        return ObservationLimits(self.observation_max_chars, half, self.observation_max_chars - half)


def optional_fields(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s fields as `create_model` definitions, each optional (default None) with its
    constraints and help, and the default it stands for kept (`common.settings.declared_default`):
    for sources that may leave any setting out (a config file, flags)."""
    return {name: (info.annotation | None, FieldInfo.merge_field_infos(
        info, default=None, json_schema_extra={DECLARED_DEFAULT: info.get_default(call_default_factory=True)}))
            for name, info in model.model_fields.items()}


# Every agent setting, none required: the agent keys of `tmax run`'s and `tmax bench run`'s
# config files, which other keys extend.
AgentSettingsPatch = create_model("AgentSettingsPatch", __base__=_NewNames, **optional_fields(AgentSettings))
