"""One training episode: the deployed agent loop, a token policy, a sandbox, a verifier.

The episode is `agents.loop.Agent` driving `agents.token_policy.TokenPolicy`, so the
context the sampler sees is the exact token list (prompt ids, sampled ids verbatim,
template-rendered observations with mask 0 / logprob 0) and never a re-rendering.

Budgets and termination, as in the Tmax recipe, come from `RolloutConfig`:
* at most `max_steps` model turns; the first turn without a valid `bash` call ends
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

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tmax.agents.driver import EpisodeDriver, EpisodeResult
from tmax.agents.policy import TokenSampler, TokenTrace
from tmax.agents.agent_settings import AgentSettings
from tmax.common.errors import ConfigError
from tmax.common.files import write_json_atomic
from tmax.sandbox.pool import SandboxPool, WarmAhead
from tmax.sandbox.pool_factory import make_pool, pool_serves_overlays
from tmax.tasks.episode import ENVIRONMENT_ERRORS, EnvSettings, Episode, PreparedTasks
from tmax.tasks.task_images import TaskImage
from tmax.tasks.task_format import Task
from tmax.tasks.verifier import VerifierKind
from tmax.training.config import BranchingConfig, RolloutConfig
from tmax.training.generator import EpisodeRequest, Rollout

if TYPE_CHECKING:
    from tmax.agents.token_policy import TokenPolicy

T = TypeVar("T")

ROLLOUT_LABEL = "io.tmax.rollout"
RUN_LABEL = "io.tmax.run"  # the run directory's id: a resumed run finds what the killed one left
INFRA_KINDS = ("task_load", "environment", "sandbox_start", "sandbox_died", "verifier_no_reward",
               "verifier_error", "model", "interrupted", "worker", "fork")


class InfraError(RuntimeError):
    """The episode could not be run for reasons that are not the policy's: re-queue it.
    `kind` (one of INFRA_KINDS) is what the metrics count it under."""

    def __init__(self, kind: str, message: str):
        if kind not in INFRA_KINDS:
            raise ValueError(f"unknown infrastructure error kind {kind!r}")
        self.kind = kind
        super().__init__(message)


def env_settings(kind: str, image_map: list[str], labels: dict[str, str] | None = None,
                 overlay: bool = False) -> EnvSettings:
    """Episodes' environments as in bench: images with the offline rewrites (`image_map`
    on top of the built-in map), or host workspaces, in sandbox `kind`; every sandbox
    carries `labels` (`run_labels`). With `overlay` (podman episodes as overlays of shared
    containers), a task that is its base image plus files is not built (`tasks.files_layer`)."""
    from tmax.tasks.offline import default_config

    return EnvSettings(kind=kind, rewrite=default_config(list(image_map)), labels=dict(labels or {}),
                       files_layer=pool_serves_overlays(kind, overlay))


def run_labels(run_dir: str | Path) -> dict[str, str]:
    """The label of every container of the run in `run_dir`, the same across resumes."""
    import hashlib

    return {RUN_LABEL: hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]}


@dataclass(frozen=True)
class EpisodeSettings:
    """What every episode of a run takes from the learn config, made once from its rollout
    section (`EpisodeSettings.of`) and handed down: to the SFT demonstrations, the rollout
    workers and each episode. Plain data, so it travels to Ray actors as it is."""

    env: EnvSettings
    agent: AgentSettings  # the rollout section's agent keys
    response_budget: int  # model + tool tokens of one trajectory
    max_prompt_tokens: int
    test_timeout: float  # the verifier's limit, at most the task's own
    harnesses: tuple[str, ...]  # rotated per group
    pool_size: int = 0  # podman: containers each worker starts ahead of need
    max_infra_retries: int = 3
    branching: BranchingConfig = field(default_factory=BranchingConfig)  # forks of each episode (`training.branching`)

    @classmethod
    def of(cls, r: RolloutConfig, labels: dict[str, str] | None = None) -> EpisodeSettings:
        harnesses = (r.harness,) if isinstance(r.harness, str) else tuple(r.harness)
        return cls(env=env_settings(r.sandbox, r.image_map, labels, r.overlay), agent=r.agent_only(),
                   response_budget=r.response_budget,
                   max_prompt_tokens=r.max_prompt_tokens, test_timeout=r.test_timeout, harnesses=harnesses,
                   pool_size=r.pool_size, max_infra_retries=r.max_infra_retries, branching=r.branching)

    def harness_for(self, group_id: int) -> str:
        """The harness of a group: every sample of a group shares it, groups rotate."""
        return self.harnesses[group_id % len(self.harnesses)]

    def token_policy(self, sampler: TokenSampler, tokenizer: Any, seed: int | None) -> TokenPolicy:
        """The token policy of one episode: the agent's sampling, the run's token budgets."""
        from tmax.agents.token_policy import TokenPolicy

        a = self.agent
        return TokenPolicy(sampler, tokenizer, temperature=a.temperature, top_p=a.top_p,
                           max_response_tokens=self.response_budget, max_context_tokens=a.context_budget,
                           max_turn_tokens=a.max_tokens, max_prompt_tokens=self.max_prompt_tokens, seed=seed)

    def worker_pool(self, slots: int, host_labels: dict[str, str] | None = None) -> SandboxPool | None:
        """A rollout worker's pool (podman): with `env.files_layer` (`rollout.overlay`), episodes
        in containers shared on this machine (carrying `host_labels` too), `pool_size` started
        ahead for coming episodes; else a fresh container per episode, its running episodes
        plus `pool_size` started ahead. A branching episode holds several sandboxes at once (a
        fork's child lives in its parent's container): room for them all."""
        slots *= self.branching.sandboxes_at_once
        return make_pool(self.env.kind, slots, self.pool_size, overlay=self.env.files_layer,
                         host_labels={**self.env.labels, **(host_labels or {})})


# ---- the episode --------------------------------------------------------------------


# A verifier run that gave no reward: the infrastructure kind it is counted under.
# A verifier timeout is not among them: it is scored 0 (see `_score`).
VERIFIER_INFRA_KINDS = {
    VerifierKind.NO_REWARD: "verifier_no_reward",
    VerifierKind.EMPTY_REWARD: "verifier_no_reward",
    VerifierKind.PARSE_ERROR: "verifier_error",
    VerifierKind.SETUP_FAILED: "verifier_error",
    VerifierKind.INFRA: "verifier_error",
}


def _score(ep: Episode, timeout: float, record_dir: Path | None) -> tuple[float, dict]:
    """The verifier's reward after a submit (tests/ are copied in only now), its logs kept
    under the episode's record dir (if any)."""
    res = ep.verify(record_dir / "verifier" if record_dir is not None else None, timeout)
    info = {"status": res.kind.value, "exit_code": res.exit_code, "duration_s": res.duration_s,
            "in_sandbox": ep.settings.kind}
    if res.kind == VerifierKind.TIMEOUT:
        # A test that hangs is the agent's doing (it left a broken state): reward 0.
        return 0.0, info
    if res.kind != VerifierKind.OK or res.reward is None:
        raise InfraError(VERIFIER_INFRA_KINDS[res.kind], f"verifier {res.kind.value}: {res.error}")
    return res.reward, info


def open_episode(req: EpisodeRequest, settings: EnvSettings, image: TaskImage | None, pool: SandboxPool | None) -> Episode:
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


@dataclass
class Drive:
    """What the agent did in one episode (or, in a branching one, along one leaf's path): its
    end, its token traces, and the time split summed over its drives."""

    result: EpisodeResult | None  # the last drive's (None only before the first)
    trace: TokenTrace | None
    segments: list[TokenTrace]
    agent_s: float = 0.0
    llm_s: float = 0.0
    exec_s: float = 0.0
    command_s: list[float] = field(default_factory=list)
    turn_outcomes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, result: EpisodeResult, policy: TokenPolicy) -> Drive:
        """The first drive of an episode by `policy` (a `TokenPolicy`)."""
        return cls(None, None, []).then(result, policy.trace, list(policy.segments))

    def then(self, result: EpisodeResult, trace: TokenTrace, segments: list[TokenTrace]) -> Drive:
        """This drive continued by `result` (a branch resumed from it)."""
        return Drive(result, trace, segments, self.agent_s + result.agent_s, self.llm_s + result.llm_s,
                     self.exec_s + result.exec_s, [*self.command_s, *result.command_s],
                     [*self.turn_outcomes, *result.turn_outcomes])


def scored(ep: Episode, result: EpisodeResult, episode: EpisodeSettings, record_dir: Path | None) -> tuple[float, dict | None, float]:
    """An ended drive's reward, verifier record and verifier seconds: InfraError for an
    ending that is the infrastructure's (`INFRA_STATUSES`) or a verifier that gave no reward."""
    if result.status in INFRA_STATUSES:
        kind, what = INFRA_STATUSES[result.status]
        raise InfraError(kind, f"{what}: {result.error}")
    if result.status != "submitted":
        return 0.0, None, 0.0
    t0 = time.monotonic()
    reward, vinfo = _score(ep, min(episode.test_timeout, ep.task.config.verifier.timeout_sec), record_dir)
    return reward, vinfo, time.monotonic() - t0


def episode_rollout(req: EpisodeRequest, ep: Episode, drive: Drive, score: tuple[float, dict | None, float],
                    harness: str, t0: float, started_at: float, sandbox_s: float, start_version: int,
                    **branch: Any) -> Rollout:
    """The record of one scored episode (or leaf of a branching one: `branch`, Rollout's branch fields)."""
    result, (reward, vinfo, verify_s) = drive.result, score
    return Rollout(
        task_id=ep.task.name, group_id=req.group_id, sample_index=req.sample_index, seed=req.seed,
        trace=drive.trace, reward=float(min(1.0, max(0.0, reward))), status=result.status, steps=result.steps,
        policy_version=min((v for t in (*drive.segments, drive.trace) for v in t.turn_versions), default=start_version),
        truncated=result.status == "context_overflow", submitted=result.status == "submitted", verifier=vinfo,
        # The agent's time split: waiting for the model, and commands running in the sandbox.
        timings={"sandbox_start_s": round(sandbox_s, 4), "agent_s": round(drive.agent_s, 3),
                 "llm_s": round(drive.llm_s, 3), "exec_s": round(drive.exec_s, 3), "verifier_s": round(verify_s, 4),
                 "total_s": round(time.monotonic() - t0, 4)},
        error=result.error, harness=harness, sandbox=ep.settings.kind, container_id=ep.sandbox_id,
        warm_start=ep.warm, segments=drive.segments, sandbox_mode=ep.sandbox_mode, command_s=drive.command_s,
        turn_outcomes=drive.turn_outcomes, started_at=round(started_at, 3), **branch)


def run_episode(
    req: EpisodeRequest,
    sampler: TokenSampler,
    tokenizer: Any,
    episode: EpisodeSettings,
    *,
    image: TaskImage | None = None,
    pool: SandboxPool | None = None,
    record_dir: Path | None = None,
    start_version: int = 0,
) -> Rollout:
    """Run one episode (`tasks.episode`) and score it. Raises InfraError for
    infrastructure failures. `image` is the task's resolved image (podman; resolved here,
    from the cache or a build, when not given: the RL loop always gives it); `pool` a
    `sandbox.pool.SandboxPool` of containers started ahead of need."""
    from tmax.agents.harnesses import make_harness
    from tmax.agents.recorder import Recorder

    t0, started_at = time.monotonic(), time.time()
    ep = open_episode(req, episode.env, image, pool)
    t_sandbox = time.monotonic() - t0
    try:
        policy = episode.token_policy(sampler, tokenizer, req.seed)
        recorder = Recorder(record_dir) if record_dir is not None else None
        harness = make_harness(episode.harness_for(req.group_id), ep.workdir)
        with EpisodeDriver(policy, ep.sandbox, harness, episode.agent, recorder=recorder) as driver:
            result = driver.run(ep.task.instruction)
        drive = Drive.of(result, policy)
        score = scored(ep, result, episode, record_dir)
        return episode_rollout(req, ep, drive, score, harness.name, t0, started_at, t_sandbox, start_version)
    finally:
        ep.close()


# ---- environments before training, warm pools, infrastructure counts -----------------


def list_task_dirs(root: str | Path) -> list[str]:
    """The Harbor tasks (dirs with task.toml) under `root`; none, or no `root`, is bad input."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"task directory not found: {root}")
    dirs = sorted(str(p) for p in root.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise ConfigError(f"no Harbor tasks (dirs with task.toml) under {root}")
    return dirs


def prepare_tasks(env: EnvSettings, task_dirs: list[str], report: Path | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  log: Callable[[str], None] | None = None) -> PreparedTasks:
    """Resolve every task's environment (`tasks.episode.prepare_environments`) before the
    first step. Unbuildable tasks are dropped, listed with their reason (and in `report`
    as JSON); only when none is left does this raise. `progress(done, total)` follows it."""
    from tmax.tasks.episode import prepare_environments

    say = log or (lambda m: print(m, file=sys.stderr))
    prepared = prepare_environments(task_dirs, env, (lambda done, total, d, err: progress(done, total))
                                    if progress else None)
    for d, why in prepared.dropped.items():
        say(f"dropped task {Path(d).name}: {why}")
    if report is not None:
        write_json_atomic(report, {"sandbox": env.kind, "runnable": prepared.runnable, "dropped": prepared.dropped})
    if prepared.dropped:
        say(f"{len(prepared.dropped)} of {len(task_dirs)} tasks dropped (environment failed); "
            f"{len(prepared.runnable)} left")
    if not prepared.runnable:
        raise InfraError("environment", f"no task of {len(task_dirs)} has a working {env.kind} environment")
    return prepared


def prewarm(pool: SandboxPool | None, task_dir: str, settings: EnvSettings, image: TaskImage | None) -> bool:
    """Start a container for a coming episode of `task_dir`; False when there is no room."""
    if pool is None or image is None:
        return False
    return Episode(Task.load(task_dir), settings, image=image, pool=pool,
                   labels={ROLLOUT_LABEL: Path(task_dir).name}).prewarm()


def run_ahead(task_dirs: list[str], episode: Callable[[int], T], settings: EnvSettings,
              images: dict[str, TaskImage | None], pool: SandboxPool | None, concurrency: int) -> list[T]:
    """`episode(i)` for every task, `concurrency` at a time in order (the results in that
    order). With a pool, each episode as it begins starts containers for the next in line,
    as many as the pool holds beyond the running episodes (`sandbox.pool.WarmAhead`; the
    caller owns and closes the pool)."""
    depth = pool.capacity - concurrency if pool is not None else 0
    ahead = WarmAhead(depth, lambda j: prewarm(pool, task_dirs[j], settings, images.get(task_dirs[j])))
    order = range(len(task_dirs))

    def one(i: int) -> T:
        ahead.fill_after(order, i, concurrency)
        return episode(i)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tmax-episode") as ex:
        return list(ex.map(one, order))
