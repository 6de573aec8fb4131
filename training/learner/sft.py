"""SFT warm start on oracle trajectories, rendered through the same harness.

A demonstration is not hand-made text: the oracle's (THOUGHT, command) steps are played
by a scripted `TokenSampler` inside the real loop (`agents.loop.Agent` + `TokenPolicy`)
in a real sandbox, and the task's verifier checks the result. So the tokens trained on
are exactly the ones a rollout would have: the prompt rendered with the chat template
and tools, each assistant turn as the template renders it, each real observation as the
template renders a tool message. Loss on assistant tokens only (mask 1).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.policy import SampledTokens
from training.config import LearnConfig
from training.rollout import EpisodeRequest, InfraError, Rollout, run_episode


class DemoError(RuntimeError):
    """An oracle demonstration could not be produced (it failed its own verifier)."""


def assistant_ids(tokenizer: Any, thought: str, command: str) -> list[int]:
    """The token ids of one assistant turn (THOUGHT + bash call + end of turn) exactly as
    the chat template renders it after a generation prompt."""
    msg = {"role": "assistant", "content": thought,
           "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]}
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    prefix = tokenizer.apply_chat_template(base, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(base + [msg], tokenize=False)
    if not full.startswith(prefix):
        raise DemoError("the chat template does not render an assistant turn after its generation prompt")
    text = full[len(prefix):]
    eot = tokenizer.eos_token
    end = text.find(eot)
    if end < 0:
        raise DemoError(f"the chat template does not end assistant turns with {eot!r}")
    return list(tokenizer.encode(text[: end + len(eot)], add_special_tokens=False))


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
            raise DemoError(f"an oracle turn of {len(ids)} tokens exceeds the per-turn budget of {max_tokens}")
        return SampledTokens(ids, [0.0] * len(ids), "stop", 0)


def oracle_demo(task_dir: str | Path, tokenizer: Any, cfg: LearnConfig) -> Rollout:
    """Play a nano task's oracle through the harness; raises DemoError unless it scores 1."""
    from training.nano.tasks import oracle_steps

    r = play_demo(task_dir, oracle_steps(task_dir), tokenizer, cfg)
    if r.reward < 1.0:
        raise DemoError(f"{task_dir}: the oracle scored {r.reward} ({r.status})")
    return r


def play_demo(task_dir: str | Path, steps: list[tuple[str, str]], tokenizer: Any, cfg: LearnConfig) -> Rollout:
    """Play scripted (THOUGHT, command) steps through the harness; the verifier scores it."""
    turns = [assistant_ids(tokenizer, t, c) for t, c in steps]
    req = EpisodeRequest(str(task_dir), 0, 0, 0)
    return run_episode(req, ScriptedSampler(turns), tokenizer, cfg.rollout)


def teacher_demo(task_dir: str | Path, tokenizer: Any, cfg: LearnConfig) -> Rollout:
    """The oracle when `sft.teacher_accuracy` is 1, else an imperfect teacher whose choice
    is drawn from a generator seeded by the run seed and the task (reproducible). A
    teacher demo is kept whatever its reward; only an oracle demo must pass."""
    from training.nano.tasks import teacher_steps

    acc = cfg.sft.teacher_accuracy
    if acc >= 1.0:
        return oracle_demo(task_dir, tokenizer, cfg)
    rng = random.Random(f"teacher-{cfg.algo.seed}-{Path(task_dir).name}")
    steps, right = teacher_steps(task_dir, acc, rng)
    r = play_demo(task_dir, steps, tokenizer, cfg)
    if right and r.reward < 1.0:
        raise DemoError(f"{task_dir}: the oracle scored {r.reward} ({r.status})")
    return r


@dataclass
class SFTResult:
    checkpoint: str
    demos: int
    tokens: int
    steps: int
    final_loss: float
    seconds: float


def collect_demos(task_dirs: list[str], tokenizer: Any, cfg: LearnConfig,
                  out_jsonl: Path | None = None) -> list[Rollout]:
    """One demonstration per task, `run.concurrency` at a time (in task order)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(d: str) -> Rollout:
        for attempt in range(cfg.rollout.max_infra_retries + 1):
            try:
                return teacher_demo(d, tokenizer, cfg)
            except InfraError:
                if attempt == cfg.rollout.max_infra_retries:
                    raise
        raise AssertionError("unreachable")

    with ThreadPoolExecutor(max_workers=cfg.run.concurrency, thread_name_prefix="tmax-demo") as ex:
        demos = list(ex.map(one, task_dirs))
    if out_jsonl is not None:
        out_jsonl.write_text("".join(r.to_json() + "\n" for r in demos))
    return demos


def train_sft(model_dir: str, demos: list[Rollout], cfg: LearnConfig, out_dir: str | Path,
              log: Any = None) -> SFTResult:
    """Cross-entropy on assistant tokens; AdamW with warmup then constant LR; writes an
    HF checkpoint (weights + tokenizer + chat template) to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.learner import checkpoint as ckpt

    if not demos:
        raise DemoError("no demonstrations to train on")
    t0 = time.monotonic()
    s = cfg.sft
    torch.manual_seed(cfg.algo.seed)
    torch.set_num_threads(s.torch_threads or os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    pad = model.config.pad_token_id or 0
    examples = [(r.prompt_ids + r.ids, [0] * len(r.prompt_ids) + r.mask) for r in demos]
    n_batches = math.ceil(len(examples) / s.batch_size)
    total = max(1, round(n_batches * s.epochs))
    warm = max(1, int(total * s.warmup_ratio))
    rng = random.Random(cfg.algo.seed)
    order: list[int] = []
    losses: list[float] = []
    tokens = 0
    for step in range(total):
        if len(order) < s.batch_size:
            more = list(range(len(examples)))
            rng.shuffle(more)
            order += more
        idx, order = order[: s.batch_size], order[s.batch_size:]
        batch = [examples[i] for i in idx]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        rows, cols, targets = [], [], []
        for b, (ids, mask) in enumerate(batch):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            attn[b, : len(ids)] = 1
            for p in range(1, len(ids)):
                if mask[p]:  # token p is predicted by the hidden state at p - 1
                    rows.append(b)
                    cols.append(p - 1)
                    targets.append(ids[p])
        for g in opt.param_groups:
            g["lr"] = s.lr * min(1.0, (step + 1) / warm)
        # The LM head only where a loss is taken: the shared ~800-token prompt needs the
        # backbone (its keys feed every assistant token) but no vocabulary projection.
        hidden = model.model(input_ids=input_ids, attention_mask=attn).last_hidden_state
        logits = model.lm_head(hidden[torch.tensor(rows), torch.tensor(cols)]).float()
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(targets))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.algo.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += len(targets)
        if log is not None:
            log(step + 1, total, losses[-1])
    path = ckpt.save_checkpoint(out_dir, model, step=0, optimizer=None,
                                extra={"sft_steps": total, "sft_demos": len(demos)}, tokenizer_dir=model_dir)
    (Path(path) / "sft.json").write_text(json.dumps({"steps": total, "demos": len(demos), "losses": losses}))
    tail = losses[-max(1, len(losses) // 10):]
    return SFTResult(str(path), len(demos), tokens, total, sum(tail) / len(tail), time.monotonic() - t0)


def select_sft_tasks(task_dirs: list[str], fraction: float, seed: int) -> list[str]:
    """A seeded subset of the train split: partial SFT leaves room for RL to improve."""
    dirs = sorted(task_dirs)
    k = max(1, round(len(dirs) * fraction))
    return sorted(random.Random(f"sft-{seed}").sample(dirs, k))


def sft_from_runs(runs_dir: str | Path, cfg: LearnConfig, out_dir: str | Path, log: Any = None) -> SFTResult:
    """SFT on the accepted `tmax run --tokens` sessions under `runs_dir` (training.runs_data),
    starting from model.path, else from the model the sessions were sampled from."""
    from training.runs_data import accepted, load_runs, model_dir_of

    runs = load_runs(runs_dir)
    demos = accepted(runs)
    if not demos:
        raise DemoError(f"none of the {len(runs)} sessions under {runs_dir} is accepted (rated /good or a passing --verify)")
    start = cfg.model.path or model_dir_of(runs)
    return train_sft(start, demos, cfg, out_dir, log=log)
