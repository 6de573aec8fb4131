"""Run configuration for `tmax learn`: one pydantic model, TOML files, five presets.

`nano` is the CPU recipe (tiny model, generated tasks, local sandboxes), `nano-podman`
the same with every episode in a podman container; `tmax-9b` is the paper's setting
(8 prompts x 32 samples, 500 steps, delta 0.1, LR 1e-6, 65,536 / 16,384 tokens, 64 tool
calls, temperature 1.0, async 4). `nano-lora` and `tmax-9b-lora` train a LoRA adapter
(`[lora]`) instead, the latter on one GPU. All ship as TOML under
`training/configs/`; a user file is validated against the same model, so a typo in a
key is an error rather than a silently ignored setting.

Where a setting comes from, later wins: the preset or file (`extends` first), then
`TMAX_LEARN_<SECTION>__<KEY>` environment variables (values in TOML syntax, e.g.
`TMAX_LEARN_ALGO__STEPS=5`, `TMAX_LEARN_TASKS__GENERATOR='{kinds = ["sort"]}'`), then the
`tmax learn` flags. `dump_toml` writes the result back (`tomli-w`): the run directory's
`config.toml` and the one file a Slurm job of `--dry-run` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Mapping

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tmax.agents.agent_settings import AgentSettings, Backoff, Count, Temperature, TopP, renamed_keys
from tmax.common.errors import ConfigError
from tmax.common.files import read_toml
from tmax.common.settings import env_layer, flag, resolve_layers
from tmax.sandbox.base import SandboxKind
from tmax.training.engine_options import EngineOptions, MemoryShare, ModelLen

CONFIG_DIR = Path(__file__).parent / "configs"
PRESETS = ("nano", "nano-podman", "nano-lora", "nano-long", "tmax-9b", "tmax-9b-lora")
ENV_PREFIX = "TMAX_LEARN_"
# Where episodes run: one flag (`-e/--env`, as `tmax run`, `tmax bench` and Harbor) for the
# training episodes and the held-out trials both.
ENV_FLAG = flag("--env", "-e", old=("--sandbox",),
                help="Where every episode runs (rollouts, demos, held-out evals): local, bwrap or podman.")


def _known_harnesses(key: str, v: str | list[str]) -> str | list[str]:
    from tmax.agents.harnesses import check_harness

    names = [v] if isinstance(v, str) else v
    if not names:
        raise ValueError(f"{key} is an empty list: name at least one harness")
    for n in names:
        check_harness(n, key)
    return v

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    # HF model dir. Empty with `nano.build = true`: the recipe builds the tiny model.
    path: str = ""
    build_nano: bool = False


class TasksConfig(_Strict):
    # Harbor-format task directories. Empty with `generate_nano = true`: generated.
    train: str = ""
    heldout: str = ""
    generate_nano: bool = False
    n_train: int = Field(64, ge=1)
    n_heldout: int = Field(32, ge=1)
    # Passed to the nano task generator (difficulty knobs it understands).
    generator: dict = Field(default_factory=dict)
    # Which generated tasks: "nano" (one command each) or "long" (several dependent commands,
    # `training.nano.long_tasks`); the nano model's tokenizer is trained on that family's text.
    family: Literal["nano", "long"] = "nano"


class RolloutConfig(AgentSettings):
    """One training episode: the agent's settings (`agents.agent_settings`, the same keys as `tmax
    run` and `tmax bench`) with the training recipe's defaults, and the training-only keys.
    Budgets and termination as in the paper: 64 tool calls, 65,536 response tokens."""

    # The agent settings whose training defaults differ from Vanillux2's (AgentSettings):
    # the policy's own distribution, the first turn without a valid bash call ends the
    # episode, room for the prompt beside the response budget, and a failing inference
    # server retried briefly (the loop re-queues the episode rather than wait out back-offs).
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    max_format_errors: Count = 1
    context_budget: Count = 67584  # prompt + response
    retries: Count = 3
    backoff_s: Backoff = (0.5, 1.0)

    # Training only.
    response_budget: int = Field(65536, ge=1)  # model + tool tokens of one trajectory
    # A rendered prompt ([system, user] + tools) longer than this ends the episode before
    # any sample (no tokens, reward 0), so its whole group has zero reward std and is
    # filtered: in effect over-long prompts are filtered out, as in the paper's recipe.
    max_prompt_tokens: int = Field(2048, ge=1)
    test_timeout: float = Field(600.0, gt=0)
    sandbox: Annotated[SandboxKind, Field(description="Where training episodes run."), ENV_FLAG] = "podman"
    image_map: Annotated[list[str], Field(
        default_factory=list, description="podman: a FROM=TO base-image rewrite for building task images offline "
                                          "(as `tmax bench --image-map`), on top of the built-in map (repeatable)."),
        flag("--image-map")]
    # podman: containers each rollout worker starts ahead of need, beyond its running
    # episodes (a fresh one per episode, never reused; 0 = start each when it begins).
    pool_size: int = Field(2, ge=0)
    # podman: each episode a fresh overlay of a container shared by the episodes of its task
    # on this machine (`sandbox.overlay_pool`), not a fresh container; what the overlay cannot
    # serve gets a fresh container each, with a warning.
    overlay: bool = True
    # Infra failures are re-queued; an episode that keeps failing aborts the run.
    max_infra_retries: int = Field(3, ge=0)
    # The harness episodes run under (`agents.harnesses`); a list is rotated per group.
    harness: str | list[str] = "tmax"

    @field_validator("harness")
    @classmethod
    def _known_harness(cls, v: str | list[str]) -> str | list[str]:
        return _known_harnesses("rollout.harness", v)

    def harness_for(self, group_id: int) -> str:
        """The harness of a group: every sample of a group shares it, groups rotate."""
        names = [self.harness] if isinstance(self.harness, str) else self.harness
        return names[group_id % len(names)]


class AlgoConfig(_Strict):
    loss: Literal["dppo", "grpo"] = "dppo"
    divergence: Literal["tv", "kl"] = "tv"
    delta: float = Field(0.1, gt=0)
    clip_low: float = Field(0.2, gt=0)  # GRPO baseline only
    clip_high: float = Field(0.272, gt=0)
    lr: float = Field(1e-6, gt=0)
    # Linear LR warmup steps, and AdamW betas / eps (defaults: torch's AdamW, no warmup).
    warmup_steps: int = Field(0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(32, ge=2)
    steps: Annotated[int, Field(ge=1, description="RL steps."), flag("--steps")] = 500
    async_steps: int = Field(4, ge=0)  # staleness limit k
    filter_zero_std: bool = True
    active_sampling: bool = True
    seed: Annotated[int, Field(description="The run's random seed (task sampling, model init)."), flag("--seed")] = 42


class EngineConfig(EngineOptions):
    """The vLLM server of each engine (`VLLMEngine.from_config`): the server options of
    `tmax serve` (`training.engine_options`, the same keys), and the weight sync."""

    # The server options whose training defaults differ from `tmax serve`'s: the recipe's
    # window (prompt + response budget), eager mode only where asked, 0.9 of GPU memory.
    max_model_len: ModelLen = 67584
    enforce_eager: bool = False
    gpu_memory_utilization: MemoryShare = 0.9

    # Training only.
    startup_timeout_s: float = Field(600.0, gt=0)
    # How the learner's weights reach the engines after a step: "object_store" (Ray
    # object store, then a file per engine), or a broadcast from learner rank 0 over a
    # process group into every engine worker ("nccl" GPU to GPU, "gloo" through host
    # memory). "auto": nccl when the learner is on a CUDA GPU, else object_store.
    weight_transport: Literal["auto", "object_store", "gloo", "nccl"] = "auto"
    weight_bucket_mb: float = Field(256.0, gt=0)
    weight_timeout_s: float = Field(600.0, gt=0)  # a weight-group collective gives up after this


class SFTConfig(_Strict):
    epochs: float = Field(1.0, gt=0)
    lr: float = Field(2e-5, gt=0)
    batch_size: int = Field(8, ge=1)
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    # Share of the train split used for SFT demonstrations (partial SFT leaves room for RL).
    task_fraction: float = Field(1.0, gt=0, le=1)
    # How often the demonstrating teacher picks the right command (1.0 = the oracle). Below
    # 1, the other demonstrations run another task kind's command and are kept although
    # they fail, like unfiltered distillation data: SFT then learns the map as a
    # distribution that RL sharpens (nano tasks only).
    teacher_accuracy: float = Field(1.0, gt=0, le=1)
    # SFT runs before any other stage of the recipe, so it may use every core (None).
    torch_threads: int | None = None


class EvalConfig(_Strict):
    attempts: int = Field(1, ge=1)
    concurrency: int = Field(4, ge=1)
    # Held-out trials are a `tmax bench` job: by default with the bench agent's settings.
    temperature: Annotated[Temperature, Field(description="Sampling temperature of the held-out trials.")] = \
        AgentSettings.model_fields["temperature"].default
    max_steps: Annotated[Count, Field(description="Model turns per held-out trial.")] = \
        AgentSettings.model_fields["max_steps"].default
    sandbox: Annotated[SandboxKind, Field(description="Where held-out trials run (`tmax bench -e`): host sandboxes "
                                                      "need no image per task."), ENV_FLAG] = "podman"
    # podman: containers started ahead for the trials next in line (`tmax bench
    # --warm-ahead`); 0: each trial starts its own when it begins. Worth it with cores to
    # spare: on 2 busy cores it only adds contention (docs/results/notebook.md, "Preset nano-podman").
    warm_ahead: int = Field(0, ge=0)
    # podman: trials as overlays of containers shared by a task's trials (`rollout.overlay`).
    overlay: bool = True
    # The harness of held-out trials (`tmax bench -a`); None: the first of `rollout.harness`,
    # the one the model trained under. Another name asks how well the training carries over.
    harness: str | None = None

    @field_validator("harness")
    @classmethod
    def _known_harness(cls, v: str | None) -> str | None:
        return v if v is None else _known_harnesses("eval.harness", v)


class RunConfig(_Strict):
    out_dir: Annotated[str, Field(description="The run directory."), flag("--out", "-o")] = "runs/learn"
    # The Ray rollout workers below hold the sandboxes of the episodes in flight.
    concurrency: Annotated[int, Field(ge=1, description="Concurrent episodes in flight (at most rollout_workers "
                                                        "* slots_per_worker)."), flag("--n-concurrent", "-n")] = 16
    rollout_workers: int = Field(4, ge=1)
    slots_per_worker: int = Field(4, ge=1)
    checkpoint_every: int = Field(20, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    wandb: bool = False
    wandb_project: str = "tmax"
    tensorboard: bool = False
    torch_threads: int | None = None
    # How N > 1 learner ranks split the work: FSDP2 shards parameters and optimizer state
    # (gloo on CPU, NCCL on GPU); replicate keeps a full copy per rank and all-reduces grads.
    learner_strategy: Literal["fsdp", "replicate"] = "fsdp"
    # Tokens one learner forward computes at most: the prefix trie of its micro-batch, where
    # a prompt its samples share counts once, so a larger budget shares more. None: the
    # rollout's context_budget (one longest sample).
    learner_pack_tokens: int | None = Field(None, ge=2)
    # Recompute each decoder layer's activations in backward instead of keeping them: the
    # learner's activation memory of a long sample drops to one hidden state per layer.
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _pool_covers_concurrency(self) -> "RunConfig":
        # The sandbox pool must hold every concurrent episode, or episodes queue on it.
        if self.rollout_workers * self.slots_per_worker < self.concurrency:
            raise ValueError(
                f"run.rollout_workers * run.slots_per_worker ({self.rollout_workers} * {self.slots_per_worker})"
                f" must be >= run.concurrency ({self.concurrency})"
            )
        return self


class ClusterConfig(_Strict):
    """Where the run's actors go and which Ray they use (`tmax learn --nodes` and its flags).

    `nodes` unset: one machine, one learner rank and one engine, on a private local Ray
    (or the cluster at `address`). Set: a placement plan over that many Ray nodes
    (`training.cluster.placement`): learner ranks on `train_nodes`, vLLM engines of `tp`
    GPUs on the rest, each role pinned by placement groups."""

    nodes: Annotated[int | None, Field(ge=1, description="Spread the run over N Ray nodes."), flag("--nodes")] = None
    gpus_per_node: Annotated[int, Field(ge=0, description="GPUs per node, 0: a CPU-only cluster."),
                             flag("--gpus-per-node")] = 8
    train_nodes: Annotated[int | None, Field(ge=1, description="Nodes for learners; the rest serve (unset: 2 of 8, "
                                                               "1 below 4 nodes)."), flag("--train-nodes")] = None
    tp: Annotated[int, Field(ge=1, description="Tensor-parallel size of each vLLM engine."), flag("--tp")] = 1
    learners_per_node: Annotated[int | None, Field(ge=1, description="Learner ranks per train node (unset: one per "
                                                                     "GPU; 1 on CPU)."), flag("--learners-per-node")] = None
    engines_per_node: Annotated[int | None, Field(ge=1, description="Engines per inference node (unset: GPUs / tp; "
                                                                    "1 on CPU)."), flag("--engines-per-node")] = None
    # `training.cluster.sandbox_nodes`: one worker per node, its episodes at once the node's CPUs.
    sandbox_nodes: Annotated[int, Field(ge=0, description="CPU nodes beyond --nodes for the rollout workers and all "
                                                          "their containers."), flag("--sandbox-nodes")] = 0
    address: Annotated[str | None, Field(description="Ray cluster to join (unset: RAY_ADDRESS, a Slurm allocation, "
                                                     "or local)."), flag("--address")] = None
    # Logical CPUs of every Ray node tmax starts (None: the machine's cores).
    num_cpus: int | None = Field(None, ge=1)
# ---- LoRA (`[lora]`): train a low-rank adapter instead of every weight --------------------
# The attention and MLP projections of a Qwen-style decoder layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Strict):
    """LoRA through PEFT (`training.learner.lora`): `rank` > 0 trains an adapter of that rank
    on `target_modules` (the base weights stay frozen and hold no optimizer state), and the
    engines serve base + adapter, taking only the adapter after each step. 0: full
    fine-tuning. Dropout stays 0 for RL: it would make the trainer's logprobs differ from
    the sampler's, which DPPO's trust region measures against."""

    rank: Annotated[int, Field(ge=0, description="Train a LoRA adapter of this rank on the frozen model (0: every "
                                                 "weight)."), flag("--lora-rank")] = 0
    alpha: float = Field(16.0, gt=0)  # the adapter's output is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class GuardConfig(_Strict):
    """The collapse guard (`training.guard` detects, `training.rollback` acts): on a
    detected collapse the step is dropped, the run goes back to its last checkpoint marked
    healthy, `remedy` is applied and training continues; after `max_rollbacks` it stops."""

    enabled: bool = False
    # The detector's rule (see training/guard.py): rolling median / MAD over `window`
    # healthy steps, alarm beyond max(mad_k * 1.4826 * MAD, the signal's floor).
    window: int = Field(8, ge=1)
    min_history: int = Field(1, ge=1)
    mad_k: float = Field(4.0, gt=0)
    min_policy_alarms: int = Field(1, ge=1)
    # Steps in a row that meet the rule before it is a collapse (a stall or a non-finite
    # update: at once). Two: a healthy run's one-step dips recover at the next step.
    patience: int = Field(2, ge=1)
    max_infra_rate: float = Field(0.25, ge=0, le=1)
    min_episodes: int = Field(8, ge=1)  # fewer finished since the last step: rollout signals not judged
    # Zero-variance groups in a row after which the episodes sampled since the last step
    # are judged (a collapsed policy fails every episode, so no batch ever fills).
    stall_groups: int = Field(16, ge=1)
    # Steps without an alarm after a checkpoint before it is marked healthy (None: the
    # staleness limit + 1, by when every episode sampled from it has been judged).
    confirm_steps: int | None = Field(None, ge=1)
    remedy: Literal["lower_lr", "raise_group_size", "skip_batch"] = "lower_lr"
    lr_factor: float = Field(0.5, gt=0, lt=1)
    group_factor: int = Field(2, ge=2)
    max_rollbacks: int = Field(3, ge=1)

    def detector(self):
        from tmax.training.guard import DetectorConfig

        return DetectorConfig(window=self.window, min_history=self.min_history, mad_k=self.mad_k,
                              min_policy_alarms=self.min_policy_alarms, patience=self.patience,
                              max_infra_rate=self.max_infra_rate, min_episodes=self.min_episodes)


class LearnConfig(_Strict):
    name: str = "custom"
    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _adapter_transport(self) -> "LearnConfig":
        if self.lora.enabled and self.engine.weight_transport in ("gloo", "nccl"):
            raise ValueError("lora.rank > 0 syncs the adapter through the object store (megabytes, not the "
                             "model): set engine.weight_transport to auto or object_store")
        return self

    @model_validator(mode="after")
    def _budgets_consistent(self) -> "LearnConfig":
        r = self.rollout
        if r.max_tokens > r.response_budget:
            raise ValueError("rollout.max_tokens must be <= rollout.response_budget")
        if r.max_prompt_tokens + r.response_budget > r.context_budget:
            raise ValueError("rollout.max_prompt_tokens + rollout.response_budget must be <= rollout.context_budget")
        if r.context_budget > self.engine.max_model_len:
            raise ValueError("rollout.context_budget must be <= engine.max_model_len")
        return self


def _new_names(data: dict, source: str) -> dict:
    """One source's `[rollout]` with old agent-setting names replaced by the new ones
    (`agents.agent_settings.RENAMED`), before it is merged with the others (whose dumps have the new)."""
    if not isinstance(data.get("rollout"), dict):
        return data
    try:
        return {**data, "rollout": renamed_keys(data["rollout"])}
    except ValueError as e:
        raise ConfigError(f"{source}: rollout: {e}") from None


def _file_layers(p: Path) -> list[tuple[dict, str]]:
    """A file's settings and those of what it `extends` (a preset name or a path next to
    it), the base first, each with the file it came from."""
    data = read_toml(p)
    parent = data.pop("extends", None)
    data = _new_names(data, str(p))
    base = _file_layers(CONFIG_DIR / f"{parent}.toml" if parent in PRESETS else (p.parent / parent)) if parent else []
    label = f"preset {p.stem}" if p.parent == CONFIG_DIR else str(p)
    return [*base, (data, label)]


def _validated(data: dict, p: Path, overridden: bool) -> LearnConfig:
    try:
        return LearnConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{p}{' with TMAX_LEARN_* / flag settings' if overridden else ''}: invalid config"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path, overrides: dict | None = None) -> LearnConfig:
    """Load a TOML file. `extends = "nano"` (or a path) starts from another config."""
    layers = _file_layers(Path(path))
    if overrides:
        layers.append((_new_names(overrides, "TMAX_LEARN_* / flag settings"), "overrides"))
    return _validated(resolve_layers(layers)[0], Path(path), bool(overrides))


def preset(name: str, overrides: dict | None = None) -> LearnConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return load_config(CONFIG_DIR / f"{name}.toml", overrides)


def env_overrides(environ: Mapping[str, str] | None = None) -> dict:
    """Settings from `TMAX_LEARN_<SECTION>__<KEY>` variables (`TMAX_LEARN_NAME` for the
    top-level key), as a nested dict; a value is read as TOML, else kept as text."""
    return env_layer(LearnConfig, ENV_PREFIX, environ, strict=True)[0]


def resolve_with_sources(config: str | Path | None, flags: dict | None = None, flag_labels: Mapping[str, str] | None = None,
                         environ: Mapping[str, str] | None = None) -> tuple[LearnConfig, dict[str, str]]:
    """The config of a run and where each setting came from: `config` (a file, or a preset
    name; None: the nano preset, each with what it `extends`), then the environment's
    `TMAX_LEARN_*` settings, then `flags` (nested like the file; `flag_labels`: the flag of
    each dotted key)."""
    if config is None or (not Path(config).exists() and str(config) in PRESETS):
        path = CONFIG_DIR / f"{config or 'nano'}.toml"
    elif not Path(config).exists() and "/" not in str(config) and not str(config).endswith(".toml"):
        raise ConfigError(f"unknown preset {str(config)!r}; choose one of {', '.join(PRESETS)} (or a TOML file)")
    else:
        path = Path(config)
    env, env_labels = env_layer(LearnConfig, ENV_PREFIX, environ, strict=True)
    layers = [*_file_layers(path), (_new_names(env, "TMAX_LEARN_* settings"), env_labels),
              (_new_names(flags or {}, "flags"), flag_labels or "flags")]
    data, sources = resolve_layers(layers)
    return _validated(data, path, bool(env or flags)), sources


def resolve(config: str | Path | None, flags: dict | None = None, environ: Mapping[str, str] | None = None) -> LearnConfig:
    """The config of a run (`resolve_with_sources` without the sources)."""
    return resolve_with_sources(config, flags, environ=environ)[0]


def dump_toml(cfg: LearnConfig) -> str:
    """The config as TOML (unset optional keys left out): `load_config` of it gives `cfg` back."""
    return tomli_w.dumps(_without_none(cfg.model_dump()))


def _without_none(d: dict) -> dict:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
