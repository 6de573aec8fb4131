"""The settings of `tmax data generate` (`GenerateConfig`), declared once: the command's
flags, their help and defaults (`cli.options.setting_flags`), the `TMAX_DATA_GENERATE_*`
variables and the record a corpus keeps of its run all come from here. A module of its own
so the CLI can make the flags without importing the pipeline (`tasks.corpus.generate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, Field

from tmax.common.records import CorpusIdentity
from tmax.common.settings import Env, flag
from tmax.sandbox.base import SandboxKind

if TYPE_CHECKING:
    from tmax.tasks.corpus.axes import AxesConfig

COMMAND = "data generate"
ENV_PREFIX = "TMAX_DATA_GENERATE_"


class GenerateConfig(BaseModel):
    out: Annotated[str, Field(description="The corpus directory (created; a rerun resumes it)."),
                   flag("--out", "-o")]
    n: Annotated[int, Field(ge=1, description="Tasks to keep."), flag("--n-tasks", "-N")]
    seed: Annotated[int, Field(description="Seed of the axes' sampling plan: the same seed, the same plan."),
                    flag("--seed")] = 0
    corpus_kind: Annotated[str, Field(description="legacy, sft_v2 or rl_v2: how strongly the newer buckets of "
                                                  "the axes are drawn."), flag("--kind")] = "legacy"
    model: Annotated[str, Field(description="The generating model's name at the endpoint."), flag("--model", "-m")]
    base_url: Annotated[str, Field(description="The OpenAI-compatible endpoint of the generating model."),
                        flag("--base-url"), Env(("TMAX_BASE_URL",))]
    n_concurrent: Annotated[int, Field(ge=1, description="Tasks generated and gated at once."),
                            flag("--n-concurrent", "-n")] = 4
    max_retries: Annotated[int, Field(ge=0, description="Times a failed gate's error goes back to the model for a "
                                                        "fix before the task is rejected."), flag("--max-retries")] = 3
    max_redraws: Annotated[int, Field(ge=0, description="New tasks drawn (from the same stratum) for a slot whose "
                                                        "task was rejected."), flag("--max-redraws")] = 3
    environment: Annotated[SandboxKind, Field(description="Where the gates run a task: podman, bwrap or local."),
                           flag("--env", "-e")] = "podman"
    max_tokens: Annotated[int, Field(ge=1, description="Tokens the model may write per answer.")] = 32768
    axes_file: Annotated[str | None, Field(description="An axes file (TOML, as tasks/data/axes.toml; unset: the "
                                                       "bundled one)."), flag("--axes")] = None

    def identity(self, axes: AxesConfig) -> CorpusIdentity:
        """What a resumed run must share with the first (the rest may change)."""
        return CorpusIdentity(seed=self.seed, n=self.n, corpus_kind=self.corpus_kind, axes=axes.fingerprint())
