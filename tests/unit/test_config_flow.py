"""Every key of `LearnConfig` reaches the code that uses it.

`SET` gives every key a value other than its default; the test fails for a key that has
none, so a new key must be given a destination here. Where the destination can be built
without Ray or a server (the vLLM command line, the LearnerConfig, the Agent's settings,
the token policy, the sandbox settings, the warm pool) the value is read back from it
(`ARRIVES`). The other keys are read inside the training loop, the recipe or the CLI;
for those (`READ_BY`) the test checks that the named module reads that key of that
section (a parse of its source, following names bound to the section).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tmax.training.config import LearnConfig

ROOT = Path(__file__).resolve().parents[2]

# A non-default value for every key (consistent: budgets fit, the pool covers concurrency).
SET: dict[str, dict] = {
    "name": "flow",
    "model": {"path": "models/flow", "build_nano": True},
    "tasks": {"train": "t/train", "heldout": "t/heldout", "generate_nano": True, "n_train": 5, "n_heldout": 6,
              "generator": {"kinds": ["sort"]}, "family": "long", "format": "text"},
    "rollout": {"max_steps": 7, "response_budget": 900, "max_tokens": 70, "max_prompt_tokens": 300,
                "context_budget": 1300, "temperature": 0.9, "top_p": 0.8, "command_timeout": 9.0,
                "test_timeout": 11.0, "observation_max_chars": 321, "max_format_errors": 2, "budget_hints": True,
                "retries": 4, "backoff_s": (0.25, 3.0), "time_budget_s": 99.0, "sandbox": "bwrap", "image_map": ["ubuntu:24.04=localhost/flow:1"], "pool_size": 5,
                "max_infra_retries": 6, "harness": ["mini-swe", "tmax"],
                "compaction": True, "compaction_threshold": 0.6, "overlay": False,
                # Off: branching refuses compaction (a fork copies one token context); its other keys set.
                "branching": {"at_turns": [3, 5], "branches": 3}},
    "algo": {"loss": "grpo", "divergence": "kl", "delta": 0.3, "clip_low": 0.25, "clip_high": 0.3, "lr": 3e-5,
             "warmup_steps": 4, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_eps": 1e-7, "weight_decay": 0.01,
             "grad_clip": 0.5, "prompts_per_step": 3, "group_size": 5, "steps": 9, "async_steps": 2,
             "filter_zero_std": False, "active_sampling": False, "seed": 13},
    "engine": {"device": "gpu", "max_model_len": 1500, "dtype": "bfloat16", "enforce_eager": True,
               "enable_prefix_caching": False, "kv_cache_gb": 3.0, "cpu_threads": 1, "gpu_memory_utilization": 0.42, "extra_args": ["--seed", "5"], "startup_timeout_s": 77.0,
               "weight_transport": "object_store", "weight_bucket_mb": 64.0, "weight_timeout_s": 55.0},
    "sft": {"epochs": 2.5, "lr": 1e-4, "batch_size": 3, "warmup_ratio": 0.1, "task_fraction": 0.5,
            "teacher_accuracy": 0.6, "torch_threads": 2, "copy_steps": 7, "copy_batch_size": 5, "copy_words": 2,
            "copy_blocks": 4, "copy_short_steps": 3, "copy_lr": 2e-3,
            "copy_context": 40},
    "eval": {"attempts": 3, "concurrency": 2, "temperature": 0.2, "max_steps": 8, "sandbox": "local", "harness": "terminus-2",
             "warm_ahead": 3, "overlay": False},
    "run": {"out_dir": "runs/flow", "concurrency": 6, "rollout_workers": 3, "slots_per_worker": 2,
            "checkpoint_every": 4, "keep_checkpoints": 5, "wandb": True, "wandb_project": "flow",
            "tensorboard": True, "torch_threads": 2, "learner_strategy": "replicate", "learner_pack_tokens": 5000,
            "gradient_checkpointing": True},
    "cluster": {"nodes": 3, "gpus_per_node": 4, "train_nodes": 2, "tp": 2, "learners_per_node": 2,
                "engines_per_node": 1, "address": "10.0.0.1:6379", "num_cpus": 3, "sandbox_nodes": 2},
    "guard": {"enabled": True, "window": 5, "min_history": 3, "mad_k": 3.0, "min_policy_alarms": 2, "patience": 3,
              "max_infra_rate": 0.4, "min_episodes": 3, "stall_groups": 7, "confirm_steps": 3, "remedy": "skip_batch", "lr_factor": 0.3,
              "group_factor": 3, "max_rollbacks": 5},
    # LoRA syncs through the object store only (engine.weight_transport above).
    "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
}

# Keys read inside code that needs Ray, a server or a whole run: (module, attribute read).
READ_BY: dict[str, tuple[str, str]] = {
    "model.path": ("tmax/training/recipe.py", "path"),
    "model.build_nano": ("tmax/training/recipe.py", "build_nano"),
    "tasks.train": ("tmax/training/recipe.py", "train"),
    "tasks.heldout": ("tmax/training/recipe.py", "heldout"),
    "tasks.generate_nano": ("tmax/training/recipe.py", "generate_nano"),
    "tasks.n_train": ("tmax/training/recipe.py", "n_train"),
    "tasks.n_heldout": ("tmax/training/recipe.py", "n_heldout"),
    "tasks.generator": ("tmax/training/recipe.py", "generator"),
    "tasks.family": ("tmax/training/recipe.py", "family"),
    "tasks.format": ("tmax/training/entry.py", "format"),
    "rollout.max_infra_retries": ("tmax/training/trainer.py", "max_infra_retries"),
    "algo.prompts_per_step": ("tmax/training/trainer.py", "prompts_per_step"),
    "algo.group_size": ("tmax/training/trainer.py", "group_size"),
    "algo.steps": ("tmax/training/trainer.py", "steps"),
    "algo.async_steps": ("tmax/training/trainer.py", "async_steps"),
    "algo.filter_zero_std": ("tmax/training/trainer.py", "filter_zero_std"),
    "algo.active_sampling": ("tmax/training/trainer.py", "active_sampling"),
    "engine.weight_transport": ("tmax/training/weights/learner_side.py", "weight_transport"),
    "engine.weight_bucket_mb": ("tmax/training/weights/learner_side.py", "weight_bucket_mb"),
    "engine.weight_timeout_s": ("tmax/training/weights/learner_side.py", "weight_timeout_s"),
    "sft.epochs": ("tmax/training/learner/sft.py", "epochs"),
    "sft.lr": ("tmax/training/learner/sft.py", "lr"),
    "sft.batch_size": ("tmax/training/learner/sft.py", "batch_size"),
    "sft.warmup_ratio": ("tmax/training/learner/sft.py", "warmup_ratio"),
    "sft.task_fraction": ("tmax/training/recipe.py", "task_fraction"),
    "sft.teacher_accuracy": ("tmax/training/demos.py", "teacher_accuracy"),
    "sft.torch_threads": ("tmax/training/learner/sft.py", "torch_threads"),
    "sft.copy_steps": ("tmax/training/learner/copy_warmup.py", "copy_steps"),
    "sft.copy_batch_size": ("tmax/training/learner/copy_warmup.py", "copy_batch_size"),
    "sft.copy_words": ("tmax/training/learner/copy_warmup.py", "copy_words"),
    "sft.copy_blocks": ("tmax/training/learner/copy_warmup.py", "copy_blocks"),
    "sft.copy_short_steps": ("tmax/training/learner/copy_warmup.py", "copy_short_steps"),
    "sft.copy_lr": ("tmax/training/learner/copy_warmup.py", "copy_lr"),
    "sft.copy_context": ("tmax/training/learner/copy_warmup.py", "copy_context"),
    "eval.attempts": ("tmax/training/recipe.py", "attempts"),
    "eval.concurrency": ("tmax/training/recipe.py", "concurrency"),
    "eval.temperature": ("tmax/training/recipe.py", "temperature"),
    "eval.max_steps": ("tmax/training/recipe.py", "max_steps"),
    "eval.sandbox": ("tmax/training/recipe.py", "sandbox"),
    "eval.harness": ("tmax/training/recipe.py", "harness"),
    "eval.warm_ahead": ("tmax/training/recipe.py", "warm_ahead"),
    "eval.overlay": ("tmax/training/recipe.py", "overlay"),
    "run.out_dir": ("tmax/cli/learn_cmd.py", "out_dir"),
    "run.concurrency": ("tmax/training/trainer.py", "concurrency"),
    "run.rollout_workers": ("tmax/training/cluster/actors.py", "rollout_workers"),
    "run.slots_per_worker": ("tmax/training/cluster/actors.py", "slots_per_worker"),
    "run.checkpoint_every": ("tmax/training/trainer.py", "checkpoint_every"),
    "run.keep_checkpoints": ("tmax/training/trainer.py", "keep_checkpoints"),
    "run.wandb": ("tmax/training/trainer.py", "wandb"),
    "run.wandb_project": ("tmax/training/trainer.py", "wandb_project"),
    "run.tensorboard": ("tmax/training/trainer.py", "tensorboard"),
    "cluster.address": ("tmax/training/cluster/launch.py", "address"),
    "cluster.num_cpus": ("tmax/training/cluster/launch.py", "num_cpus"),
    "run.torch_threads": ("tmax/training/cluster/actors.py", "torch_threads"),
    "guard.enabled": ("tmax/training/rollback.py", "enabled"),
    "guard.stall_groups": ("tmax/training/rollback.py", "stall_groups"),
    "guard.confirm_steps": ("tmax/training/rollback.py", "confirm_steps"),
    "guard.remedy": ("tmax/training/rollback.py", "remedy"),
    "guard.lr_factor": ("tmax/training/rollback.py", "lr_factor"),
    "guard.group_factor": ("tmax/training/rollback.py", "group_factor"),
    "guard.max_rollbacks": ("tmax/training/rollback.py", "max_rollbacks"),
}


def _arrivals(cfg: LearnConfig, d: dict) -> dict[str, list[tuple[object, object]]]:
    """Key -> [(what arrived where it is used, what should have)] for keys whose
    destination is built here. `d` holds the destinations (see the `built` fixture)."""
    r, a, e = cfg.rollout, cfg.algo, cfg.engine
    argv, gpu_env, cpu_env = d["gpu_argv"], d["gpu_env"], d["cpu_env"]
    agent, policy, learner, env = d["agent"], d["policy"], d["learner"], d["env"]
    plan, c = d["plan"], cfg.cluster
    g, det = cfg.guard, d["detector"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    return {
        "name": [(d["dumped"]["name"], cfg.name)],
        "rollout.max_steps": [(agent.max_steps, r.max_steps)],
        "rollout.response_budget": [(policy.max_response_tokens, r.response_budget)],
        "rollout.max_tokens": [(policy.max_turn_tokens, r.max_tokens), (agent.max_tokens, r.max_tokens)],
        "rollout.max_prompt_tokens": [(policy.max_prompt_tokens, r.max_prompt_tokens)],
        "rollout.context_budget": [(policy.max_context_tokens, r.context_budget),
                                   (agent.context_budget, r.context_budget)],
        "rollout.temperature": [(policy.temperature, r.temperature), (agent.temperature, r.temperature),
                                (learner.temperature, r.temperature)],
        "rollout.top_p": [(policy.top_p, r.top_p), (agent.top_p, r.top_p)],
        "rollout.command_timeout": [(agent.command_timeout, r.command_timeout)],
        "rollout.observation_max_chars": [(agent.observation_max_chars, r.observation_max_chars)],
        "rollout.max_format_errors": [(agent.max_format_errors, r.max_format_errors)],
        "rollout.budget_hints": [(agent.budget_hints, r.budget_hints)],
        "rollout.retries": [(agent.retries, r.retries)],
        "rollout.backoff_s": [(agent.backoff_s, r.backoff_s)],
        "rollout.time_budget_s": [(agent.time_budget_s, r.time_budget_s)],
        "rollout.compaction": [(agent.compaction, r.compaction)],
        "rollout.compaction_threshold": [(agent.compaction_threshold, r.compaction_threshold)],
        "rollout.sandbox": [(env.kind, r.sandbox)],
        "rollout.image_map": [([f"{m.pattern}={m.target}" for m in env.rewrite.rules[:1]], r.image_map)],
        "rollout.pool_size": [(d["pool"].capacity, d["slots"] + r.pool_size)],
        "rollout.overlay": [(d["env"].files_layer, r.overlay and r.sandbox == "podman"), (type(d["pool"]).__name__, "WarmPool")],
        "rollout.test_timeout": [(d["episode"].test_timeout, r.test_timeout)],
        "rollout.harness": [([d["episode"].harness_for(g) for g in range(2)], r.harness)],
        "rollout.branching": [(d["episode"].branching, r.branching)],
        "algo.loss": [(learner.loss.loss_fn, a.loss)],
        "algo.divergence": [(learner.loss.divergence, a.divergence)],
        "algo.delta": [(learner.loss.delta, a.delta)],
        "algo.clip_low": [(learner.loss.clip_low, a.clip_low)],
        "algo.clip_high": [(learner.loss.clip_high, a.clip_high)],
        "algo.lr": [(learner.lr, a.lr)],
        "algo.warmup_steps": [(learner.warmup_steps, a.warmup_steps)],
        "algo.adam_beta1": [(learner.betas[0], a.adam_beta1)],
        "algo.adam_beta2": [(learner.betas[1], a.adam_beta2)],
        "algo.adam_eps": [(learner.eps, a.adam_eps)],
        "algo.weight_decay": [(learner.weight_decay, a.weight_decay)],
        "algo.grad_clip": [(learner.max_grad_norm, a.grad_clip)],
        "algo.seed": [(learner.seed, a.seed), (policy.seed, a.seed)],
        "engine.device": [(d["gpu_spec"].device, e.device)],
        "engine.max_model_len": [(flag("--max-model-len"), str(e.max_model_len))],
        "engine.enable_prefix_caching": [("--no-enable-prefix-caching" in argv, not e.enable_prefix_caching)],
        "engine.dtype": [(flag("--dtype"), e.dtype)],
        "engine.enforce_eager": [("--enforce-eager" in argv, e.enforce_eager)],
        "engine.kv_cache_gb": [(cpu_env["VLLM_CPU_KVCACHE_SPACE"], str(int(e.kv_cache_gb)))],
        "engine.cpu_threads": [(cpu_env["OMP_NUM_THREADS"], str(e.cpu_threads))],
        "engine.gpu_memory_utilization": [(flag("--gpu-memory-utilization"), str(e.gpu_memory_utilization))],
        "engine.extra_args": [(argv[-len(e.extra_args):], e.extra_args)],
        "engine.startup_timeout_s": [(d["engine_kwargs"]["startup_timeout_s"], e.startup_timeout_s)],
        "run.learner_strategy": [(learner.strategy, cfg.run.learner_strategy)],
        "run.learner_pack_tokens": [(learner.pack_length, cfg.run.learner_pack_tokens)],
        "run.gradient_checkpointing": [(learner.gradient_checkpointing, cfg.run.gradient_checkpointing)],
        # The learner's adapter (training.learner.lora.LoraSpec), its base in the engine's dtype.
        "lora.rank": [(learner.lora.rank, cfg.lora.rank), (learner.dtype, e.dtype)],
        "lora.alpha": [(learner.lora.alpha, cfg.lora.alpha)],
        "lora.dropout": [(learner.lora.dropout, cfg.lora.dropout)],
        "lora.target_modules": [(list(learner.lora.target_modules), cfg.lora.target_modules)],
        # The placement plan of a `[cluster]` section (training.cluster.placement.plan_for).
        "cluster.nodes": [(plan.nodes, c.nodes)],
        "cluster.gpus_per_node": [(plan.gpus_per_node, c.gpus_per_node)],
        "cluster.train_nodes": [(plan.train_nodes, c.train_nodes)],
        "cluster.tp": [(plan.tp, c.tp), (flag("--tensor-parallel-size"), str(c.tp))],
        "cluster.learners_per_node": [(plan.learners_per_node, c.learners_per_node)],
        "cluster.engines_per_node": [(plan.engines_per_node, c.engines_per_node)],
        "cluster.sandbox_nodes": [(plan.sandbox_nodes, c.sandbox_nodes), (plan.sandbox_workers, c.sandbox_nodes)],
        "guard.window": [(det.window, g.window)],
        "guard.min_history": [(det.min_history, g.min_history)],
        "guard.mad_k": [(det.mad_k, g.mad_k)],
        "guard.min_policy_alarms": [(det.min_policy_alarms, g.min_policy_alarms)],
        "guard.patience": [(det.patience, g.patience)],
        "guard.max_infra_rate": [(det.max_infra_rate, g.max_infra_rate)],
        "guard.min_episodes": [(det.min_episodes, g.min_episodes)],
        # Dev mode, which the training engine always runs in.
        "_engine_dev_mode": [(gpu_env.get("VLLM_SERVER_DEV_MODE"), "1")],
    }


def _keys() -> list[str]:
    keys = []
    for section, field in LearnConfig.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        keys += [f"{section}.{k}" for k in sub] if sub else [section]
    return keys


def _reads(module: str, section: str, attr: str) -> bool:
    """Whether `module` reads `attr` of the `section` config: `cfg.section.attr`, or
    `x.attr` where `x` was bound to the section (`a = cfg.algo`, `self.ecfg = cfg.engine`,
    a parameter typed with the section's class)."""
    tree = ast.parse((ROOT / module).read_text())
    cls = LearnConfig.model_fields[section].annotation.__name__

    def name(node: ast.AST) -> str | None:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None

    aliases = {section}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and cls in ast.unparse(node.annotation):
            aliases.add(node.arg)
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
                else:
                    pairs.append((target, node.value))
    grown = True
    while grown:
        new = {name(t) for t, v in pairs if name(v) in aliases and name(t)} - aliases
        aliases |= new
        grown = bool(new)
    return any(isinstance(n, ast.Attribute) and n.attr == attr and name(n.value) in aliases for n in ast.walk(tree))


@pytest.fixture(scope="module")
def tokenizer():
    from tmax.training.nano.model import build_tokenizer

    return build_tokenizer(0)


@pytest.fixture(scope="module")
def cfg() -> LearnConfig:
    return LearnConfig.model_validate(SET)


@pytest.fixture(scope="module")
def built(cfg, tokenizer, tmp_path_factory):
    """Every destination that can be built without Ray or a server."""
    from tmax.sandbox.pool import WarmPool
    from tmax.training.config import dump_toml
    from tmax.training.inference import engine as engine_mod
    from tmax.training.inference.serving import build_command
    from tmax.training.cluster.actors import _tp
    from tmax.training.cluster.placement import plan_for
    from tmax.training.cluster.reservation import Placement
    from tmax.training.trainer import learner_config
    from tmax.training.rollout import EpisodeSettings

    model_dir = tmp_path_factory.mktemp("model")
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    # What a placed run's engine actors get besides the engine section: the plan's TP size.
    tp = _tp(Placement(plan_for(cfg), None, None, [], []))
    engine_kwargs = {}
    mp = pytest.MonkeyPatch()
    try:
        # VLLMEngine.from_config's arguments to the engine, which would start a server.
        mp.setattr(engine_mod.VLLMEngine, "__init__", lambda self, model_dir, **kw: engine_kwargs.update(kw))
        engine_mod.VLLMEngine.from_config(cfg.engine, model_dir, work_dir="w", tensor_parallel_size=tp)
        gpu_spec = engine_mod.engine_spec(model_dir, engine_kwargs["options"],
                                          tensor_parallel_size=engine_kwargs["tensor_parallel_size"])
        mp.setenv("CUDA_VISIBLE_DEVICES", "0")  # only builds the GPU command line, starts nothing
        gpu = build_command(gpu_spec)
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        cpu = build_command(engine_mod.engine_spec(model_dir, cfg.engine.model_copy(update={"device": "cpu"})))
    finally:
        mp.undo()
    slots = 2
    episode = EpisodeSettings.of(cfg.rollout)
    pool = EpisodeSettings.of(cfg.rollout.model_copy(update={"sandbox": "podman"})).worker_pool(slots)
    assert isinstance(pool, WarmPool)
    import tomllib

    return {
        "gpu_argv": gpu.argv, "gpu_env": gpu.env, "cpu_env": cpu.env, "gpu_spec": gpu_spec,
        "engine_kwargs": engine_kwargs,
        "agent": episode.agent, "policy": episode.token_policy(None, tokenizer, cfg.algo.seed), "episode": episode,
        "learner": learner_config(cfg), "env": episode.env, "pool": pool, "slots": slots,
        "dumped": tomllib.loads(dump_toml(cfg)), "detector": cfg.guard.detector(),
        "plan": plan_for(cfg),
    }


def test_every_key_is_set_to_a_non_default_value(cfg):
    default = LearnConfig()
    for key in _keys():
        section, _, k = key.partition(".")
        assert key.count(".") == 1 or key == "name", key
        if key == "name":
            continue
        assert section in SET and k in SET[section], f"{key}: give it a non-default value in SET and a destination"
        assert getattr(getattr(cfg, section), k) != getattr(getattr(default, section), k), key


def test_every_key_arrives_where_it_is_used(cfg, built):
    arrivals = _arrivals(cfg, built)
    for key in _keys():
        assert (key in arrivals) != (key in READ_BY), f"{key}: needs exactly one destination (ARRIVES or READ_BY)"
        for arrived, expected in arrivals.get(key, []):
            assert arrived == expected, f"{key}: {arrived!r} arrived, {expected!r} was set"
    for key in arrivals:
        assert key.startswith("_") or key in _keys(), f"{key} is not a LearnConfig key"


@pytest.mark.parametrize("key", sorted(READ_BY))
def test_keys_read_inside_the_run_are_read(key):
    module, attr = READ_BY[key]
    section = key.split(".")[0]
    assert _reads(module, section, attr), f"{module} does not read {key} ({section}.{attr})"


def test_the_reader_check_can_fail():
    assert not _reads("tmax/training/recipe.py", "algo", "group_size")
    assert not _reads("tmax/training/trainer.py", "engine", "gpu_memory_utilization")


def test_a_prompt_over_max_prompt_tokens_ends_the_episode_before_any_sample(cfg, tokenizer, tmp_path):
    """Every sample of such a prompt ends unsampled with reward 0, so its group has zero
    reward std and is filtered (the paper filters over-long prompts out)."""
    from tmax.agents.loop import Agent
    from tmax.sandbox import SandboxSpec, make_sandbox
    from tmax.training.rollout import EpisodeSettings

    class NeverCalled:
        def sample(self, *args, **kwargs):
            raise AssertionError("a prompt over the limit was sampled")

    short = EpisodeSettings.of(cfg.rollout.model_copy(update={"max_prompt_tokens": 16}))
    policy = short.token_policy(NeverCalled(), tokenizer, seed=1)
    box = make_sandbox("local", SandboxSpec(workdir=str(tmp_path)))
    box.start()
    try:
        result = Agent(policy, box, short.agent).run("Sort lemon.txt into out.txt.")
    finally:
        box.close()
    assert result.status == "context_overflow" and "over the limit of 16" in (result.error or "")
    assert len(policy.trace.prompt_ids) > 16 and policy.trace.ids == []
