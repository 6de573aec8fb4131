"""One training episode: the deployed agent loop, a token policy, a sandbox, a verifier.

The episode is `agents.loop.Agent` driving `agents.token_policy.TokenPolicy`, so the
context the sampler sees is the exact token list (prompt ids, sampled ids verbatim,
template-rendered observations with mask 0 / logprob 0) and never a re-rendering.

Budgets (reference item 15) and termination (item 16) come from `RolloutConfig`:
* at most `max_tool_calls` model turns; the first turn without a valid `bash` call ends
  the episode (`max_format_errors = 1`);
* per-turn tokens = max(1, min(remaining response budget, remaining context, per-turn cap)),
  enforced by the token policy, which raises `ContextOverflow` when a budget is used up;
* reward (item 17): the task's verifier, run only after a submit (tests are copied in at
  that moment, never before), clamped to [0, 1]; 0 for every other ending. Overlong
  episodes are kept as reward-0 negatives.

Infrastructure failures (a sandbox that will not start or dies, a verifier that cannot
run, an inference server that keeps failing) raise `InfraError`: the orchestrator drops
and re-queues the episode. They are never scored as reward 0.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agents.loop import Agent, AgentConfig
from agents.policy import TokenSampler
from sandbox.base import SandboxError, SandboxSpec
from tasks.model import Task
from training.config import RolloutConfig

HOST_KINDS = ("local", "bwrap")


class InfraError(RuntimeError):
    """The episode could not be run for reasons that are not the policy's: re-queue it."""


@dataclass
class EpisodeRequest:
    task_dir: str
    group_id: int
    sample_index: int
    seed: int
    attempt: int = 0  # re-queues after infrastructure failures

    @property
    def key(self) -> str:
        return f"{self.group_id}:{self.sample_index}"


@dataclass
class Rollout:
    """Everything the trainer and a later analysis need about one episode."""

    task_id: str
    group_id: int
    sample_index: int
    seed: int
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    reward: float
    status: str  # submitted | max_steps | context_overflow | format_errors
    steps: int
    policy_version: int  # weights version of the oldest sampled turn
    turn_versions: list[int] = field(default_factory=list)
    truncated: bool = False
    submitted: bool = False
    verifier: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    harness: str = "tmax"

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def agent_config(cfg: RolloutConfig, max_steps: int | None = None) -> AgentConfig:
    return AgentConfig(
        max_steps=max_steps or cfg.max_tool_calls,
        command_timeout=cfg.command_timeout,
        max_format_errors=cfg.max_format_errors,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.per_turn_max_tokens,
        context_budget=cfg.context_budget,
        observation_max_chars=cfg.observation_max_chars,
        budget_hints=cfg.budget_hints,
        # A failing inference server is an infrastructure problem: retry briefly, then let
        # the orchestrator re-queue the episode rather than wait out long back-offs.
        retries=3,
        backoff_s=(0.5, 1.0),
    )


def token_policy(sampler: TokenSampler, tokenizer: Any, cfg: RolloutConfig, seed: int | None):
    from agents.token_policy import TokenPolicy

    return TokenPolicy(
        sampler,
        tokenizer,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_response_tokens=cfg.response_budget,
        max_context_tokens=cfg.context_budget,
        max_turn_tokens=cfg.per_turn_max_tokens,
        seed=seed,
    )


def prompt_length(tokenizer: Any, instruction: str) -> int:
    """Tokens of the rendered [system, user] prompt with tools, as the token policy renders it."""
    from agents.prompts import instance_message, system_message
    from agents.tools import TOOLS

    text = tokenizer.apply_chat_template([system_message(), instance_message(instruction)], tools=TOOLS,
                                         add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---- sandboxes ----------------------------------------------------------------------


@dataclass
class EpisodeSandbox:
    sandbox: Any
    workdir: str  # agent start dir and verifier cwd, as seen inside the sandbox
    host_root: Path | None  # per-episode temp dir (host kinds), removed on close

    def close(self) -> None:
        try:
            self.sandbox.close()
        finally:
            if self.host_root is not None:
                shutil.rmtree(self.host_root, ignore_errors=True)


def _seed_files(task: Task, workdir: Path) -> None:
    """What the task Dockerfile's `COPY files/ ./` does, for host sandboxes."""
    files = task.environment_dir / "files"
    if files.is_dir():
        shutil.copytree(files, workdir, dirs_exist_ok=True)


def open_sandbox(task: Task, kind: str, scratch: str | Path | None = None, image: str | None = None) -> EpisodeSandbox:
    """A fresh sandbox for one episode. Host kinds get a fresh temp work dir seeded with the
    task's files; podman gets a fresh container of the task image."""
    from sandbox import make_sandbox

    if kind in HOST_KINDS:
        # The episode root is the (bwrap: writable, same-path) workspace; the agent starts
        # in root/work, and root/tests + root/logs appear only when the verifier runs. Keep
        # `scratch` outside /tmp: bwrap gives the jail a private /tmp.
        if scratch is not None:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="tmax-ep-", dir=scratch)).resolve()
        work = root / "work"
        work.mkdir()
        _seed_files(task, work)
        spec = SandboxSpec(workdir=str(work), workspace=root)
        box = make_sandbox(kind, spec)
        ep = EpisodeSandbox(box, str(work), root)
    elif kind == "podman":
        if image is None:
            raise InfraError(f"task {task.name}: no image for the podman sandbox")
        from tasks.images import image_workdir

        workdir = image_workdir(image) or "/app"
        spec = SandboxSpec(image=image, workdir=workdir, network=task.config.environment.allow_internet,
                           cpus=task.config.environment.cpus, memory_mb=task.config.environment.memory_mb)
        ep = EpisodeSandbox(make_sandbox(kind, spec), workdir, None)
    else:
        raise ValueError(f"unknown sandbox kind {kind!r}; use local, bwrap or podman")
    try:
        ep.sandbox.start()
    except Exception as e:
        ep.close()
        raise InfraError(f"sandbox could not start: {e}") from e
    return ep


def verify(ep: EpisodeSandbox, task: Task, kind: str, out_dir: Path, timeout: float) -> tuple[float, dict]:
    """Run the task's verifier after a submit; returns (reward in [0, 1], details).

    In a container this is Harbor's protocol (`tasks.verifier.run_verifier`). A host sandbox
    has no private /tests or /logs, so the same test.sh runs from a per-episode copy of
    `tests/` with `TMAX_WORKDIR` / `TMAX_LOGS_DIR` pointing into the episode's temp dir
    (the generated nano tasks honour both). The tests are copied at this point only."""
    from tasks.verifier import parse_reward, run_verifier

    if kind not in HOST_KINDS:
        try:
            res = run_verifier(ep.sandbox, task, ep.workdir, out_dir, timeout=timeout)
        except SandboxError as e:
            raise InfraError(f"verifier could not run: {e}") from e
        if res.reward is None:
            raise InfraError(f"verifier {res.status}: {res.error}")
        return res.reward, {"status": res.status, "exit_code": res.exit_code, "duration_s": res.duration_s}

    assert ep.host_root is not None
    tests, logs = ep.host_root / "tests", ep.host_root / "logs"
    shutil.copytree(task.tests_dir, tests)
    (logs / "verifier").mkdir(parents=True)
    env = {"TMAX_WORKDIR": ep.workdir, "TMAX_LOGS_DIR": str(logs), **task.config.verifier.env}
    t0 = time.monotonic()
    try:
        res = ep.sandbox.exec(["bash", str(tests / "test.sh")], timeout=timeout, workdir=ep.workdir, env=env)
    except SandboxError as e:
        raise InfraError(f"verifier could not run: {e}") from e
    duration = time.monotonic() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "test-stdout.txt").write_text(res.output + res.stderr)
    if res.timed_out:
        # A test that hangs is the agent's doing (it left a broken state): reward 0.
        return 0.0, {"status": "timeout", "exit_code": res.exit_code, "duration_s": duration}
    rfile = logs / "verifier" / "reward.txt"
    reward, why = parse_reward(rfile.read_text() if rfile.exists() else None, None)
    if reward is None:
        raise InfraError(f"verifier wrote no reward ({why}); test.sh exit {res.exit_code}")
    return reward, {"status": "ok", "exit_code": res.exit_code, "duration_s": duration}


# ---- the episode --------------------------------------------------------------------


def run_episode(
    req: EpisodeRequest,
    sampler: TokenSampler,
    tokenizer: Any,
    cfg: RolloutConfig,
    *,
    scratch: str | Path | None = None,
    image: str | None = None,
    record_dir: Path | None = None,
    start_version: int = 0,
) -> Rollout:
    """Run one episode and score it. Raises InfraError for infrastructure failures."""
    from agents.harnesses import make_harness
    from agents.records import Recorder

    t0 = time.monotonic()
    try:
        task = Task.load(req.task_dir)
    except Exception as e:  # a task that fails to load is a data problem, not the policy's
        raise InfraError(f"task {req.task_dir} does not load: {e}") from e
    ep = open_sandbox(task, cfg.sandbox, scratch, image)
    t_sandbox = time.monotonic() - t0
    harness = make_harness(cfg.harness_for(req.group_id), ep.workdir)
    try:
        policy = token_policy(sampler, tokenizer, cfg, req.seed)
        recorder = Recorder(record_dir) if record_dir is not None else None
        agent = Agent(policy, ep.sandbox, agent_config(cfg), recorder=recorder, harness=harness)
        t1 = time.monotonic()
        result = agent.run(task.instruction)
        t_agent = time.monotonic() - t1
        if result.status == "sandbox_error":
            raise InfraError(f"sandbox failed during the episode: {result.error}")
        if result.status == "model_error":
            raise InfraError(f"inference server failed: {result.error}")
        if result.status == "interrupted":
            raise InfraError("episode interrupted")
        trace = policy.trace
        reward, vinfo, t_verify = 0.0, None, 0.0
        submitted = result.status == "submitted"
        if submitted:
            t2 = time.monotonic()
            out = (record_dir or ep.host_root or Path(tempfile.gettempdir())) / "verifier"
            timeout = min(cfg.test_timeout, task.config.verifier.timeout_sec)
            reward, vinfo = verify(ep, task, cfg.sandbox, out, timeout)
            t_verify = time.monotonic() - t2
    finally:
        harness.close()
        ep.close()
    versions = list(trace.turn_versions)
    return Rollout(
        task_id=task.name,
        group_id=req.group_id,
        sample_index=req.sample_index,
        seed=req.seed,
        prompt_ids=list(trace.prompt_ids),
        ids=list(trace.ids),
        logprobs=list(trace.logprobs),
        mask=list(trace.mask),
        reward=float(min(1.0, max(0.0, reward))),
        status=result.status,
        steps=result.steps,
        policy_version=min(versions) if versions else start_version,
        turn_versions=versions,
        truncated=result.status == "context_overflow",
        submitted=submitted,
        verifier=vinfo,
        timings={
            "sandbox_start_s": round(t_sandbox, 4),
            "agent_s": round(t_agent, 4),
            "verifier_s": round(t_verify, 4),
            "total_s": round(time.monotonic() - t0, 4),
        },
        error=result.error,
        harness=harness.name,
    )


def append_jsonl(path: Path, line: str) -> None:
    """One rollout per line, written with a single write so a crash never splits one."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
