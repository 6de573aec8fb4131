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
from tmax.training.guard import GuardConfig

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
    path: Annotated[str, Field(description="The Hugging Face model directory trained (and served). Empty with "
                                           "`build_nano`: the recipe's own tiny model.")] = ""
    build_nano: Annotated[bool, Field(description="Build the nano recipe's tiny model (and its tokenizer) in the "
                                                  "run directory instead of loading `path`.")] = False


class TasksConfig(_Strict):
    train: Annotated[str, Field(description="Directory of Harbor-format tasks RL samples from. Empty with "
                                            "`generate_nano`: generated.")] = ""
    heldout: Annotated[str, Field(description="Directory of Harbor-format tasks scored before and after training, "
                                              "never trained on. Empty with `generate_nano`: generated.")] = ""
    generate_nano: Annotated[bool, Field(description="Generate the recipe's small tasks into the run directory "
                                                     "instead of reading `train` and `heldout`.")] = False
    n_train: Annotated[int, Field(ge=1, description="Generated training tasks (with `generate_nano`).")] = 64
    n_heldout: Annotated[int, Field(ge=1, description="Generated held-out tasks (with `generate_nano`); more give a "
                                                      "steadier before/after figure and a longer eval.")] = 32
    generator: Annotated[dict, Field(default_factory=dict, description="Knobs passed to the task generator, e.g. "
                                     "`{kinds = [\"sort\"]}` to generate only some task kinds.")]
    format: Annotated[Literal["harbor", "text"], Field(description=(
        "What tasks.train holds, and so which generator plays the episodes: \"harbor\" task directories (each "
        "episode an agent in a sandbox, scored by the task's verifier) or \"text\", a JSONL file of "
        "{\"id\", \"prompt\", \"answer\"} lines (one model turn each, no sandbox)."))] = "harbor"
    # The nano model's tokenizer is trained on the chosen family's text.
    family: Annotated[Literal["nano", "long"], Field(description="Which tasks are generated: nano (one command "
                                                                 "each) or long (several dependent commands).")] = "nano"


class BranchingConfig(_Strict):
    """Branching rollouts (docs/learn.md, "Branching rollouts"): at fixed turns each episode's
    sandbox is forked and `branches` continuations run on from it, sharing its token prefix;
    each stretch of turns between branch points gets its own advantage from the siblings
    below it (`training.algo.tree`)."""

    enabled: Annotated[bool, Field(description="Fork each episode at `at_turns` and run `branches` continuations "
                                               "from each fork (off: every episode runs alone).")] = False
    at_turns: Annotated[list[int], Field(min_length=1, description="After which model turns an episode forks "
                                                                   "(increasing; an episode that ends sooner does "
                                                                   "not).")] = [2]
    branches: Annotated[int, Field(ge=2, description="Continuations run from each fork.")] = 2

    @field_validator("at_turns")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v) or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"at_turns must be increasing turn numbers >= 1, got {v}")
        return v

    @property
    def leaves(self) -> int:
        """Episodes a root episode becomes when it reaches every branch point."""
        return self.branches ** len(self.at_turns) if self.enabled else 1

    @property
    def sandboxes_at_once(self) -> int:
        """The most sandboxes one episode holds at once: its leaves, and at the last forks their
        parents too (closed once their children exist)."""
        return self.leaves + self.leaves // self.branches if self.enabled else 1


class RolloutConfig(AgentSettings):
    """One training episode: the agent's settings (`agents.agent_settings`, the same keys as `tmax
    run` and `tmax bench`) with the training recipe's defaults, and the training-only keys.
    Budgets and termination as in the paper: 64 tool calls, 65,536 response tokens."""

    # The agent settings whose training defaults differ from Vanillux2's (AgentSettings):
    # the policy's own distribution, the first turn without a valid bash call ends the
    # episode, room for the prompt beside the response budget, and a failing inference
    # server retried briefly (the loop re-queues the episode rather than wait out back-offs).
    temperature: Annotated[Temperature, Field(description="Sampling temperature of training episodes (1.0: the "
                                                          "policy's own distribution, which the loss assumes).")] = 1.0
    top_p: Annotated[TopP, Field(description="Nucleus sampling of training episodes (1.0: off).")] = 1.0
    max_format_errors: Annotated[Count, Field(description="Turns without a valid bash call before the episode "
                                                          "ends (reward 0).")] = 1
    context_budget: Annotated[Count, Field(description="Tokens of one episode's context, prompt and response "
                                                       "together; at most `engine.max_model_len`.")] = 67584
    retries: Annotated[Count, Field(description="Attempts of a failing model request before the episode is "
                                                "re-queued.")] = 3
    backoff_s: Annotated[Backoff, Field(description="Seconds waited before each retry of a model request.")] = (0.5, 1.0)

    # Training only.
    response_budget: Annotated[int, Field(ge=1, description="Tokens of one trajectory after its prompt, model and "
                                                            "tool output together; the episode ends there.")] = 65536
    # Such an episode has no tokens and reward 0, so its whole group has zero reward std and
    # is filtered: in effect over-long prompts are filtered out, as in the paper's recipe.
    max_prompt_tokens: Annotated[int, Field(ge=1, description="A rendered first prompt (system, task, tools) "
                                                              "longer than this ends the episode before sampling.")] = 2048
    test_timeout: Annotated[float, Field(gt=0, description="Seconds a task's tests may take to score an episode.")] = 600.0
    sandbox: Annotated[SandboxKind, Field(description="Where training episodes run."), ENV_FLAG] = "podman"
    image_map: Annotated[list[str], Field(
        default_factory=list, description="podman: a FROM=TO base-image rewrite for building task images offline "
                                          "(as `tmax bench --image-map`), on top of the built-in map (repeatable)."),
        flag("--image-map")]
    # Each container is fresh for one episode, never reused.
    pool_size: Annotated[int, Field(ge=0, description="podman: containers each rollout worker starts ahead of need, "
                                                      "beyond its running episodes (0: each when it begins).")] = 2
    # `sandbox.overlay_pool`: what the overlay cannot serve gets a fresh container, with a warning.
    overlay: Annotated[bool, Field(description="podman: each episode a fresh overlay of a container its task's "
                                               "episodes share, instead of a fresh container (faster starts).")] = True
    max_infra_retries: Annotated[int, Field(ge=0, description="Re-queues of an episode whose sandbox or server "
                                                              "failed; one that keeps failing stops the run.")] = 3
    harness: Annotated[str | list[str], Field(description="The agent harness episodes run under (tmax, mini-swe, "
                                                          "terminus-2); a list is rotated per group.")] = "tmax"
    branching: Annotated[BranchingConfig, Field(default_factory=BranchingConfig, description=(
        "Branching rollouts: fork episodes at fixed turns and credit each stretch of turns from its "
        "continuations (`[rollout.branching]`)."))]

    @field_validator("harness")
    @classmethod
    def _known_harness(cls, v: str | list[str]) -> str | list[str]:
        return _known_harnesses("rollout.harness", v)

    def harness_for(self, group_id: int) -> str:
        """The harness of a group: every sample of a group shares it, groups rotate."""
        names = [self.harness] if isinstance(self.harness, str) else self.harness
        return names[group_id % len(names)]


class AlgoConfig(_Strict):
    loss: Annotated[Literal["dppo", "grpo"], Field(description="The policy loss: dppo (divergence trust region, "
                                                               "the paper's) or grpo (ratio clipping, a baseline).")] = "dppo"
    divergence: Annotated[Literal["tv", "kl"], Field(description="DPPO's divergence between the sampler's and the "
                                                                 "learner's token distributions: total variation or KL.")] = "tv"
    delta: Annotated[float, Field(gt=0, description="DPPO's trust region: tokens whose divergence exceeds it get no "
                                                    "gradient. Larger: bigger, riskier updates.")] = 0.1
    clip_low: Annotated[float, Field(gt=0, description="GRPO only: the ratio clip below 1 (1 - clip_low).")] = 0.2
    clip_high: Annotated[float, Field(gt=0, description="GRPO only: the ratio clip above 1 (1 + clip_high).")] = 0.272
    lr: Annotated[float, Field(gt=0, description="Learning rate of RL (AdamW).")] = 1e-6
    # Defaults: torch's AdamW, no warmup.
    warmup_steps: Annotated[int, Field(ge=0, description="RL steps of linear learning-rate warmup.")] = 0
    adam_beta1: Annotated[float, Field(ge=0, lt=1, description="AdamW's first-moment decay.")] = 0.9
    adam_beta2: Annotated[float, Field(ge=0, lt=1, description="AdamW's second-moment decay.")] = 0.999
    adam_eps: Annotated[float, Field(gt=0, description="AdamW's epsilon.")] = 1e-8
    weight_decay: Annotated[float, Field(ge=0, description="AdamW's weight decay.")] = 0.0
    grad_clip: Annotated[float, Field(gt=0, description="Gradients are clipped to this global norm.")] = 1.0
    prompts_per_step: Annotated[int, Field(ge=1, description="Tasks (groups) per RL step.")] = 8
    group_size: Annotated[int, Field(ge=2, description="Episodes sampled per task; rewards are compared within "
                                                       "a group, so a step trains on prompts_per_step * group_size.")] = 32
    steps: Annotated[int, Field(ge=1, description="RL steps."), flag("--steps")] = 500
    async_steps: Annotated[int, Field(ge=0, description="Staleness limit: episodes may be sampled by weights up to "
                                                        "this many steps old (0: fully on-policy, slower).")] = 4
    filter_zero_std: Annotated[bool, Field(description="Drop groups whose episodes all got the same reward: they "
                                                       "carry no learning signal.")] = True
    active_sampling: Annotated[bool, Field(description="Keep sampling groups until a step has prompts_per_step "
                                                       "groups with a signal, instead of training on fewer.")] = True
    seed: Annotated[int, Field(description="The run's random seed (task sampling, model init)."), flag("--seed")] = 42


class EngineConfig(EngineOptions):
    """The vLLM server of each engine (`VLLMEngine.from_config`): the server options of
    `tmax serve` (`training.engine_options`, the same keys), and the weight sync."""

    # The server options whose training defaults differ from `tmax serve`'s: the recipe's
    # window (prompt + response budget), eager mode only where asked, 0.9 of GPU memory.
    max_model_len: Annotated[ModelLen, Field(description="The engine's context window in tokens (prompt + "
                                                         "response); at least `rollout.context_budget`.")] = 67584
    enforce_eager: Annotated[bool, Field(description="Run without CUDA graphs or torch.compile: slower sampling, "
                                                     "faster start.")] = False
    gpu_memory_utilization: Annotated[MemoryShare, Field(description="Share of GPU memory the engine may take "
                                                                     "(weights and KV cache).")] = 0.9

    # Training only.
    startup_timeout_s: Annotated[float, Field(gt=0, description="Seconds an engine may take to start before the run "
                                                                "fails.")] = 600.0
    # object_store: Ray's object store, then a file per engine; nccl / gloo: a broadcast from
    # learner rank 0 over a process group into every engine worker.
    weight_transport: Annotated[Literal["auto", "object_store", "gloo", "nccl"], Field(
        description="How the learner's weights reach the engines after a step: object_store, gloo (through host "
                    "memory) or nccl (GPU to GPU); auto: nccl when the learner is on a CUDA GPU, else object_store.")] = "auto"
    weight_bucket_mb: Annotated[float, Field(gt=0, description="MiB of weights sent per broadcast (gloo, nccl).")] = 256.0
    weight_timeout_s: Annotated[float, Field(gt=0, description="Seconds a weight broadcast may take before the run "
                                                               "fails.")] = 600.0


class SFTConfig(_Strict):
    epochs: Annotated[float, Field(gt=0, description="Passes over the demonstrations (fractions allowed).")] = 1.0
    lr: Annotated[float, Field(gt=0, description="Peak learning rate of SFT.")] = 2e-5
    batch_size: Annotated[int, Field(ge=1, description="Demonstrations per SFT step.")] = 8
    warmup_ratio: Annotated[float, Field(ge=0, lt=1, description="Share of SFT steps with a linear learning-rate "
                                                                 "warmup.")] = 0.03
    task_fraction: Annotated[float, Field(gt=0, le=1, description="Share of the training tasks demonstrated in "
                                                                  "SFT; a partial SFT leaves room for RL.")] = 1.0
    # Below 1, the other demonstrations run another task kind's command and are kept although
    # they fail, like unfiltered distillation data: SFT learns the map as a distribution RL sharpens.
    teacher_accuracy: Annotated[float, Field(gt=0, le=1, description="How often the demonstrating teacher picks "
                                                                     "the right command (1.0: always; nano tasks only).")] = 1.0
    # A random-init model cannot copy a value it read, nor learn it from SFT (`learner.copy_warmup`).
    copy_steps: Annotated[int, Field(ge=0, description="Steps of copy pre-training before SFT, on lines of "
                                                       "train-split values some of which repeat an earlier line, "
                                                       "loss on every token (0: none).")] = 0
    copy_batch_size: Annotated[int, Field(ge=1, description="Sequences per copy pre-training step.")] = 16
    copy_words: Annotated[int, Field(ge=1, description="Values on one line of a copy pre-training sequence.")] = 3
    copy_blocks: Annotated[int, Field(ge=2, description="Lines of a copy pre-training sequence (each new values or "
                                                        "an earlier line's again).")] = 12
    copy_short_steps: Annotated[int, Field(ge=0, description="Of the copy pre-training steps, the first ones on two-line "
                                                             "sequences (a line, then it again), as many tokens a step.")] = 0
    copy_context: Annotated[int, Field(ge=0, description="After the two-line steps, up to this many tokens of prompt text "
                                                         "before a copy sequence, 1/16 of it between lines, no loss (0: none).")] = 0
    copy_lr: Annotated[float, Field(gt=0, description="Peak learning rate of copy pre-training (its warmup: "
                                                      "`warmup_ratio` of its steps).")] = 3e-3
    # SFT runs before any other stage of the recipe, so it may use every core; threads that wait
    # for a core another process holds slow every step (`learner.sft.CoreShare`).
    torch_threads: Annotated[int | None, Field(description="CPU threads of SFT's torch (unset: the cores other "
                                                           "processes leave free, looked at every 16 steps).")] = None


class EvalConfig(_Strict):
    attempts: Annotated[int, Field(ge=1, description="Attempts per held-out task (pass@k over them).")] = 1
    concurrency: Annotated[int, Field(ge=1, description="Held-out trials run at once.")] = 4
    # Held-out trials are a `tmax bench` job: by default with the bench agent's settings.
    temperature: Annotated[Temperature, Field(description="Sampling temperature of the held-out trials.")] = \
        AgentSettings.model_fields["temperature"].default
    max_steps: Annotated[Count, Field(description="Model turns per held-out trial.")] = \
        AgentSettings.model_fields["max_steps"].default
    sandbox: Annotated[SandboxKind, Field(description="Where held-out trials run (`tmax bench -e`): host sandboxes "
                                                      "need no image per task."), ENV_FLAG] = "podman"
    # On 2 busy cores it only adds contention (docs/results/notebook.md, "Preset nano-podman").
    warm_ahead: Annotated[int, Field(ge=0, description="podman: containers started ahead for the trials next in "
                                                       "line (0: each when it begins); worth it with cores to spare.")] = 0
    overlay: Annotated[bool, Field(description="podman: held-out trials as overlays of containers a task's trials "
                                               "share (as `rollout.overlay`).")] = True
    harness: Annotated[str | None, Field(description="The harness of held-out trials (unset: the first of "
                                                     "`rollout.harness`); another asks how well training carries over.")] = None

    @field_validator("harness")
    @classmethod
    def _known_harness(cls, v: str | None) -> str | None:
        return v if v is None else _known_harnesses("eval.harness", v)


class RunConfig(_Strict):
    out_dir: Annotated[str, Field(description="The run directory."), flag("--out", "-o")] = "runs/learn"
    # The Ray rollout workers below hold the sandboxes of the episodes in flight.
    concurrency: Annotated[int, Field(ge=1, description="Concurrent episodes in flight (at most rollout_workers "
                                                        "* slots_per_worker)."), flag("--n-concurrent", "-n")] = 16
    rollout_workers: Annotated[int, Field(ge=1, description="Ray actors that run episodes and hold their "
                                                            "sandboxes.")] = 4
    slots_per_worker: Annotated[int, Field(ge=1, description="Episodes each rollout worker runs at once.")] = 4
    checkpoint_every: Annotated[int, Field(ge=1, description="RL steps between checkpoints (a resume starts from "
                                                             "the last).")] = 20
    keep_checkpoints: Annotated[int, Field(ge=1, description="Checkpoints kept on disk; older ones are deleted.")] = 3
    wandb: Annotated[bool, Field(description="Log each step's figures to Weights & Biases.")] = False
    wandb_project: Annotated[str, Field(description="The Weights & Biases project (with `wandb`).")] = "tmax"
    tensorboard: Annotated[bool, Field(description="Write each step's figures as TensorBoard events in the run "
                                                   "directory.")] = False
    torch_threads: Annotated[int | None, Field(description="CPU threads of the learner's torch (unset: torch's "
                                                           "choice).")] = None
    # FSDP2 runs over gloo on CPU, NCCL on GPU.
    learner_strategy: Annotated[Literal["fsdp", "replicate"], Field(
        description="How several learner ranks split the work: fsdp shards parameters and optimizer state; "
                    "replicate keeps a full copy per rank and all-reduces gradients.")] = "fsdp"
    # The prefix trie of a micro-batch counts a prompt its samples share once, so a larger
    # budget shares more.
    learner_pack_tokens: Annotated[int | None, Field(ge=2, description="Tokens one learner forward computes at "
                                                                       "most (unset: `rollout.context_budget`).")] = None
    # The activation memory of a long sample drops to one hidden state per layer.
    gradient_checkpointing: Annotated[bool, Field(description="Recompute each layer's activations in backward "
                                                              "instead of keeping them: less memory, more time.")] = False

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
    num_cpus: Annotated[int | None, Field(ge=1, description="Logical CPUs of every Ray node tmax starts (unset: "
                                                            "the machine's cores).")] = None
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
    alpha: Annotated[float, Field(gt=0, description="The adapter's scale: its output is multiplied by alpha / "
                                                    "rank.")] = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1, description="Dropout inside the adapter (keep 0 for RL).")] = 0.0
    target_modules: Annotated[list[str], Field(default_factory=lambda: list(LORA_TARGETS), min_length=1,
                                               description="The layers given an adapter (default: every attention "
                                                           "and MLP projection).")]

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LearnConfig(_Strict):
    name: Annotated[str, Field(description="The run's name in logs, reports and trackers.")] = "custom"
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
        if r.branching.enabled and self.tasks.format != "harbor":
            raise ValueError("rollout.branching forks sandboxed episodes: it needs tasks.format = \"harbor\"")
        if r.branching.enabled and r.compaction:
            raise ValueError("rollout.branching forks a single token context: set rollout.compaction = false")
        if r.branching.enabled and r.branching.at_turns[-1] >= r.max_steps:
            raise ValueError("rollout.branching.at_turns must be below rollout.max_steps (a branch needs a turn left)")
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
