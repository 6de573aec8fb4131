"""One training episode: the deployed agent loop, a token policy, a sandbox, a verifier.

The episode is `agents.loop.Agent` driving `agents.token_policy.TokenPolicy`, so the
context the sampler sees is the exact token list (prompt ids, sampled ids verbatim,
template-rendered observations with mask 0 / logprob 0) and never a re-rendering.

Budgets and termination, as in the Tmax recipe, come from `RolloutConfig`:
* at most `max_tool_calls` model turns; the first turn without a valid `bash` call ends
  the episode (`max_format_errors = 1`);
* per-turn tokens = max(1, min(remaining response budget, remaining context, per-turn cap)),
  enforced by the token policy, which raises `ContextOverflow` when a budget is used up;
* reward: the task's verifier, run only after a submit (tests are copied in at
  that moment, never before), clamped to [0, 1]; 0 for every other ending. Overlong
  episodes are kept as reward-0 negatives.

The environment, sandbox and verifier are `tasks.episode`, the same path a `tmax bench`
trial takes: the task's image (resolved before training) with its task.toml limits on
podman, or a fresh host workspace on bwrap / local.

Infrastructure failures (a sandbox that will not start or dies, a verifier that cannot
run or writes no reward, an inference server that keeps failing) raise `InfraError` with
a kind: the training loop drops and re-queues the episode and counts it in
`env/infra_errors/<kind>`. They are never scored as reward 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from agents.loop import Agent, AgentConfig
from agents.policy import TokenSampler, TokenTrace
from sandbox.base import SandboxError
from sandbox.pool import WarmPool
from tasks.episode import ENVIRONMENT_ERRORS, EnvSettings, Episode, PreparedTasks
from tasks.images import TaskImage
from tasks.model import Task
from training.config import RolloutConfig

T = TypeVar("T")

ROLLOUT_LABEL = "io.tmax.rollout"
RUN_LABEL = "io.tmax.run"  # the run directory's id: a resumed run finds what the killed one left
INFRA_KINDS = ("task_load", "environment", "sandbox_start", "sandbox_died", "verifier_no_reward",
               "verifier_error", "model", "interrupted", "worker")


class InfraError(RuntimeError):
    """The episode could not be run for reasons that are not the policy's: re-queue it.
    `kind` (one of INFRA_KINDS) is what the metrics count it under."""

    def __init__(self, kind: str, message: str):
        if kind not in INFRA_KINDS:
            raise ValueError(f"unknown infrastructure error kind {kind!r}")
        self.kind = kind
        super().__init__(message)


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
    """Everything the trainer and a later analysis need about one episode. `trace` is the
    token policy's `TokenTrace`, kept as it is: the trainer packs it (training.learner.packing)."""

    task_id: str
    group_id: int
    sample_index: int
    seed: int
    trace: TokenTrace
    reward: float
    status: str  # submitted | max_steps | context_overflow | format_errors
    steps: int
    policy_version: int  # weights version of the oldest sampled turn
    truncated: bool = False
    submitted: bool = False
    verifier: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    harness: str = "tmax"
    sandbox: str = ""  # the sandbox kind the episode ran in
    container_id: str | None = None  # podman: the container the episode (and verifier) ran in
    warm_start: bool = False  # the container came started from the worker's warm pool

    @property
    def num_sampled(self) -> int:
        return self.trace.num_sampled

    @property
    def ids(self) -> list[int]:
        """The response tokens (`trace.ids`)."""
        return self.trace.ids

    @property
    def turn_versions(self) -> list[int]:
        """The weights version of each sampled turn (`trace.turn_versions`)."""
        return self.trace.turn_versions

    def to_json(self) -> str:
        """One flat JSON object: the episode's fields and the trace's lists side by side."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        return json.dumps({**record, **asdict(self.trace)})

    @classmethod
    def from_json(cls, line: str) -> "Rollout":
        record = json.loads(line)
        trace = TokenTrace(**{f.name: record.pop(f.name) for f in fields(TokenTrace) if f.name in record})
        return cls(trace=trace, **record)


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
        # the training loop re-queue the episode rather than wait out long back-offs.
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
        max_prompt_tokens=cfg.max_prompt_tokens,
        seed=seed,
    )


# ---- the episode --------------------------------------------------------------------


def env_settings(cfg: RolloutConfig, labels: dict[str, str] | None = None) -> EnvSettings:
    """The environment of every rollout: as in bench (images with the offline rewrites,
    or host workspaces), in `cfg.sandbox`; every sandbox carries `labels` (`run_labels`)."""
    from tasks.offline import default_config

    return EnvSettings(kind=cfg.sandbox, rewrite=default_config(list(cfg.image_map)), labels=dict(labels or {}))


def run_labels(run_dir: str | Path) -> dict[str, str]:
    """The label of every container of the run in `run_dir`, the same across resumes."""
    import hashlib

    return {RUN_LABEL: hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]}


def _score(ep: Episode, out_dir: Path | None, timeout: float) -> tuple[float, dict]:
    """The verifier's reward after a submit (tests/ are copied in only now)."""
    try:
        res = ep.verify(out_dir, timeout)
    except SandboxError as e:
        raise InfraError("verifier_error", f"verifier could not run: {e}") from e
    info = {"status": res.status, "exit_code": res.exit_code, "duration_s": res.duration_s,
            "in_sandbox": ep.settings.kind}
    if res.status == "timeout":
        # A test that hangs is the agent's doing (it left a broken state): reward 0.
        return 0.0, info
    if res.reward is None:
        kind = "verifier_no_reward" if "was written" in (res.error or "") else "verifier_error"
        raise InfraError(kind, f"verifier {res.status}: {res.error}")
    return res.reward, info


def _open(req: EpisodeRequest, settings: EnvSettings, image: TaskImage | None, pool: Any) -> Episode:
    try:
        task = Task.load(req.task_dir)
    except Exception as e:  # a task that fails to load is a data problem, not the policy's
        raise InfraError("task_load", f"task {req.task_dir} does not load: {e}") from e
    ep = Episode(task, settings, image=image, pool=pool, labels={ROLLOUT_LABEL: task.name})
    try:
        ep.open()
    except ENVIRONMENT_ERRORS as e:
        ep.close()
        raise InfraError("environment", str(e)) from e
    except Exception as e:
        ep.close()
        raise InfraError("sandbox_start", f"sandbox could not start: {e}") from e
    return ep


# Agent outcomes that are the infrastructure's failure, not the policy's: (kind, text).
INFRA_STATUSES = {
    "sandbox_error": ("sandbox_died", "sandbox failed during the episode"),
    "model_error": ("model", "inference server failed"),
    "interrupted": ("interrupted", "episode interrupted"),
}


def _verify(ep: Any, timeout: float, record_dir: Path | None) -> tuple[float, dict | None]:
    """The verifier's reward, its logs kept under the episode's record dir (if any)."""
    return _score(ep, record_dir / "verifier" if record_dir is not None else None, timeout)


def run_episode(
    req: EpisodeRequest,
    sampler: TokenSampler,
    tokenizer: Any,
    cfg: RolloutConfig,
    *,
    settings: EnvSettings | None = None,
    image: TaskImage | None = None,
    pool: Any = None,
    record_dir: Path | None = None,
    start_version: int = 0,
) -> Rollout:
    """Run one episode (`tasks.episode`) and score it. Raises InfraError for
    infrastructure failures. `image` is the task's resolved image (podman; resolved here,
    from the cache or a build, when not given: the RL loop always gives it); `pool` a
    `sandbox.pool.WarmPool` of containers started ahead of need."""
    from agents.harnesses import make_harness
    from agents.records import Recorder

    t0 = time.monotonic()
    ep = _open(req, settings or env_settings(cfg), image, pool)
    t_sandbox = time.monotonic() - t0
    task, sandbox_id, warm = ep.task, ep.sandbox_id, ep.warm
    harness = make_harness(cfg.harness_for(req.group_id), ep.workdir)
    try:
        policy = token_policy(sampler, tokenizer, cfg, req.seed)
        recorder = Recorder(record_dir) if record_dir is not None else None
        agent = Agent(policy, ep.sandbox, agent_config(cfg), recorder=recorder, harness=harness)
        t1 = time.monotonic()
        result = agent.run(task.instruction)
        t_agent = time.monotonic() - t1
        # The agent's time split: waiting for the model, and commands running in the sandbox.
        t_llm = sum(t.get("llm_s", 0.0) for t in agent.timing)
        t_exec = sum(t.get("bash_s", 0.0) for t in agent.timing)
        if result.status in INFRA_STATUSES:
            kind, what = INFRA_STATUSES[result.status]
            raise InfraError(kind, f"{what}: {result.error}")
        trace = policy.trace
        reward, vinfo, t_verify = 0.0, None, 0.0
        submitted = result.status == "submitted"
        if submitted:
            t2 = time.monotonic()
            reward, vinfo = _verify(ep, min(cfg.test_timeout, task.config.verifier.timeout_sec), record_dir)
            t_verify = time.monotonic() - t2
    finally:
        harness.close()
        ep.close()
    return Rollout(
        task_id=task.name,
        group_id=req.group_id,
        sample_index=req.sample_index,
        seed=req.seed,
        trace=trace,
        reward=float(min(1.0, max(0.0, reward))),
        status=result.status,
        steps=result.steps,
        policy_version=min(trace.turn_versions, default=start_version),
        truncated=result.status == "context_overflow",
        submitted=submitted,
        verifier=vinfo,
        timings={
            "sandbox_start_s": round(t_sandbox, 4),
            "agent_s": round(t_agent, 4),
            "llm_s": round(t_llm, 4),
            "exec_s": round(t_exec, 4),
            "verifier_s": round(t_verify, 4),
            "total_s": round(time.monotonic() - t0, 4),
        },
        error=result.error,
        harness=harness.name,
        sandbox=ep.settings.kind,
        container_id=sandbox_id,
        warm_start=warm,
    )


# ---- environments before training, warm pools, infrastructure counts -----------------


def prepare_tasks(cfg: RolloutConfig, task_dirs: list[str], report: Path | None = None, progress: bool = False,
                  log: Any = None) -> PreparedTasks:
    """Resolve every task's environment (`tasks.episode.prepare_environments`) before the
    first step. Unbuildable tasks are dropped, listed with their reason (and in `report`
    as JSON); only when none is left does this raise."""
    from rich.progress import Progress

    from tasks.episode import prepare_environments

    say = log or (lambda m: print(m, file=sys.stderr))
    settings = env_settings(cfg)
    with Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task(f"task environments ({cfg.sandbox})", total=len(task_dirs))
        prepared = prepare_environments(task_dirs, settings, lambda done, total, d, err: bar.update(job, completed=done))
    for d, why in prepared.dropped.items():
        say(f"dropped task {Path(d).name}: {why}")
    if report is not None:
        report.write_text(json.dumps({"sandbox": cfg.sandbox, "runnable": prepared.runnable,
                                      "dropped": prepared.dropped}, indent=2))
    if prepared.dropped:
        say(f"{len(prepared.dropped)} of {len(task_dirs)} tasks dropped (environment failed); "
            f"{len(prepared.runnable)} left")
    if not prepared.runnable:
        raise InfraError("environment", f"no task of {len(task_dirs)} has a working {cfg.sandbox} environment")
    return prepared


def worker_pool(cfg: RolloutConfig, slots: int) -> WarmPool | None:
    """A rollout worker's pool: its running episodes plus `pool_size` started ahead (podman)."""
    if cfg.sandbox != "podman" or cfg.pool_size == 0:
        return None
    return WarmPool(slots + cfg.pool_size)


def prewarm(pool: WarmPool | None, task_dir: str, settings: EnvSettings, image: TaskImage | None) -> bool:
    """Start a container for a coming episode of `task_dir`; False when there is no room."""
    if pool is None or image is None:
        return False
    return Episode(Task.load(task_dir), settings, image=image, pool=pool,
                   labels={ROLLOUT_LABEL: Path(task_dir).name}).prewarm()


def run_ahead(task_dirs: list[str], episode: Callable[[int], T], settings: EnvSettings,
              images: dict[str, TaskImage | None], pool: WarmPool | None, concurrency: int) -> list[T]:
    """`episode(i)` for every task, `concurrency` at a time in order (the results in that
    order). With a pool, each episode first starts the container of the one that will take
    its slot next, so that one finds it warm (the caller owns and closes the pool)."""
    def one(i: int) -> T:
        ahead = i + concurrency
        if ahead < len(task_dirs):
            prewarm(pool, task_dirs[ahead], settings, images.get(task_dirs[ahead]))
        return episode(i)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tmax-episode") as ex:
        return list(ex.map(one, range(len(task_dirs))))


def prewarm_queue(queue: Any, workers: list, next_worker: int, per_worker: int, done: set) -> None:
    """Ask each worker to start containers for the queued requests it will receive next
    (dispatch is round-robin in queue order), `per_worker` ahead, each request once."""
    for j, req in enumerate(list(queue)[: per_worker * len(workers)]):
        key = (req.group_id, req.sample_index, req.attempt)
        if key not in done:
            done.add(key)
            workers[(next_worker + j) % len(workers)].prewarm.remote(req.task_dir)


@dataclass
class InfraCounts:
    """Infrastructure errors of a run by kind (`env/infra_errors`, `env/infra_errors/<kind>`)."""

    by_kind: dict[str, int] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)  # kind -> the latest message, for people

    def add(self, kind: str, task_dir: str, message: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.last[kind] = f"{Path(task_dir).name}: {message}"

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def metrics(self) -> dict[str, float]:
        return {"env/infra_errors": float(self.total),
                **{f"env/infra_errors/{k}": float(v) for k, v in sorted(self.by_kind.items())}}


def append_jsonl(path: Path, line: str) -> None:
    """One rollout per line, written with a single write so a crash never splits one."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
