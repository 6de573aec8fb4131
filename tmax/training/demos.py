"""Demonstrations for the SFT warm start: oracle or teacher episodes, played through the
harness as rollouts are.

A demonstration is not hand-made text: the oracle's (THOUGHT, command) steps, written as
the model of the demo's harness (`rollout.harness`) would write them (`Harness.demo_turns`),
are played by a scripted `TokenSampler` inside the real loop (`agents.loop.Agent` +
`TokenPolicy`) in a real sandbox, and the task's verifier checks the result. So the
tokens trained on are exactly the ones a rollout would have: the prompt rendered with the
chat template (and tools), each assistant turn as the template renders it, each real
observation as the template renders that harness's observation message. The demos are
`Rollout`s; `training.learner.sft.train_sft` trains on them (loss on the assistant tokens).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tmax.agents.harnesses import make_harness
from tmax.agents.policy import SampledTokens
from tmax.common.files import write_text_atomic
from tmax.training.config import LearnConfig
from tmax.training.nano.tasks import oracle_steps, teacher_steps
from tmax.training.rollout import EpisodeRequest, EpisodeSettings, InfraError, Rollout, run_ahead, run_episode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tmax.sandbox.pool import SandboxPool
    from tmax.tasks.task_images import TaskImage


class DemoError(RuntimeError):
    """An oracle demonstration could not be produced (it failed its own verifier)."""


def assistant_ids(tokenizer: PreTrainedTokenizerBase, message: dict[str, Any]) -> list[int]:
    """The token ids of one assistant message (up to its end of turn) exactly as the chat
    template renders it after a generation prompt."""
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    prefix = tokenizer.apply_chat_template(base, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(base + [message], tokenize=False)
    if not full.startswith(prefix):
        raise DemoError("the chat template does not render an assistant turn after its generation prompt")
    text = full[len(prefix):]
    eot = tokenizer.eos_token
    end = text.find(eot)
    if end < 0:
        raise DemoError(f"the chat template does not end assistant turns with {eot!r}")
    return list(tokenizer.encode(text[: end + len(eot)], add_special_tokens=False))


def scripted_turns(tokenizer: PreTrainedTokenizerBase, steps: list[tuple[str, str]], harness: str = "tmax") -> list[list[int]]:
    """The sampled turns that play (THOUGHT, command) steps under `harness`, each written
    as that harness's model would (`Harness.demo_turns`; terminus-2 adds its confirmation)."""
    h = make_harness(harness)
    return [assistant_ids(tokenizer, m) for thought, command in steps for m in h.demo_turns(thought, command)]


class ScriptedSampler:
    """A TokenSampler that answers each turn with the next pre-rendered assistant turn."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)

    def sample(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
               seed: int | None = None) -> SampledTokens:
        if not self.turns:
            raise DemoError("the oracle script has no more turns")
        ids = self.turns.pop(0)
        if len(ids) > max_tokens:
            raise DemoError(f"an oracle turn of {len(ids)} tokens exceeds the per-turn budget of {max_tokens} "
                            "(rollout.max_tokens)")
        return SampledTokens(ids, [0.0] * len(ids), "stop", 0)


def oracle_demo(task_dir: str | Path, tokenizer: PreTrainedTokenizerBase, episode: EpisodeSettings, *, group_id: int = 0,
                image: TaskImage | None = None, pool: SandboxPool | None = None) -> Rollout:
    """Play a nano task's oracle through the harness; raises DemoError unless it scores 1."""
    r = play_demo(task_dir, oracle_steps(task_dir), tokenizer, episode, group_id=group_id, image=image, pool=pool)
    if r.reward < 1.0:
        raise DemoError(f"{task_dir}: the oracle scored {r.reward} ({r.status})")
    return r


def play_demo(task_dir: str | Path, steps: list[tuple[str, str]], tokenizer: PreTrainedTokenizerBase, episode: EpisodeSettings, *,
              group_id: int = 0, image: TaskImage | None = None, pool: SandboxPool | None = None) -> Rollout:
    """Play scripted (THOUGHT, command) steps through the harness of group `group_id`
    (`episode.harness_for`), as its rollouts would run; the verifier scores it. `image`
    and `pool` as for `run_episode`."""
    turns = scripted_turns(tokenizer, steps, episode.harness_for(group_id))
    req = EpisodeRequest(str(task_dir), group_id, 0, 0)
    return run_episode(req, ScriptedSampler(turns), tokenizer, episode, image=image, pool=pool)


def teacher_demo(task_dir: str | Path, tokenizer: PreTrainedTokenizerBase, cfg: LearnConfig, episode: EpisodeSettings, *,
                 group_id: int = 0, image: TaskImage | None = None, pool: SandboxPool | None = None) -> Rollout:
    """The oracle when `sft.teacher_accuracy` is 1, else an imperfect teacher whose choice
    is drawn from a generator seeded by the run seed and the task (reproducible). A
    teacher demo is kept whatever its reward; only an oracle demo must pass."""
    acc = cfg.sft.teacher_accuracy
    if acc >= 1.0:
        return oracle_demo(task_dir, tokenizer, episode, group_id=group_id, image=image, pool=pool)
    rng = random.Random(f"teacher-{cfg.algo.seed}-{Path(task_dir).name}")
    steps, right = teacher_steps(task_dir, acc, rng)
    r = play_demo(task_dir, steps, tokenizer, episode, group_id=group_id, image=image, pool=pool)
    if right and r.reward < 1.0:
        raise DemoError(f"{task_dir}: the oracle scored {r.reward} ({r.status})")
    return r


def collect_demos(task_dirs: list[str], tokenizer: PreTrainedTokenizerBase, cfg: LearnConfig, out_jsonl: Path | None = None,
                  images: dict[str, TaskImage | None] | None = None) -> list[Rollout]:
    """One demonstration per task, `run.concurrency` at a time (in task order); demo i is
    group i, so a list of `rollout.harness` names gives demos under each in turn. `images`:
    the tasks' environments resolved before (`prepare_tasks`); with them, podman demos
    take containers from a warm pool started ahead, as rollouts do (without, each episode
    resolves its image and starts its own container)."""
    images = images or {}
    slots = cfg.run.concurrency
    episode = EpisodeSettings.of(cfg.rollout)
    pool = episode.worker_pool(slots) if images else None

    def one(i: int) -> Rollout:
        d = task_dirs[i]
        for attempt in range(episode.max_infra_retries + 1):
            try:
                return teacher_demo(d, tokenizer, cfg, episode, group_id=i, image=images.get(d), pool=pool)
            except InfraError:
                if attempt == episode.max_infra_retries:
                    raise
        raise AssertionError("unreachable")

    try:
        demos = run_ahead(task_dirs, one, episode.env, images, pool, slots)
    finally:
        if pool is not None:
            pool.close()
    if out_jsonl is not None:
        write_text_atomic(out_jsonl, "".join(r.to_json() + "\n" for r in demos))
    return demos


def select_sft_tasks(task_dirs: list[str], fraction: float, seed: int) -> list[str]:
    """A seeded subset of the train split: partial SFT leaves room for RL to improve."""
    dirs = sorted(task_dirs)
    k = max(1, round(len(dirs) * fraction))
    return sorted(random.Random(f"sft-{seed}").sample(dirs, k))
