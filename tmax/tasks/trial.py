"""One trial: an episode (`tasks.episode`: image -> container -> agent -> verifier) and
its outcome, in a Harbor trial dir. On the host sandboxes (bwrap, local) a fresh
workspace stands in for the image and the verifier runs from a per-trial copy of tests/.

    <trial>/config.json           what was run (written first)
    <trial>/result.json           reward, timings, exception info (written last, atomically)
    <trial>/agent/                trajectory.json etc. (tmax), oracle.txt (oracle)
    <trial>/verifier/             reward.txt, test-stdout.txt, ctrf.json
    <trial>/exception.txt         the traceback when something went wrong

result.json is `tasks.harbor.TrialResult`. Its outcome label (pass | fail | agent_timeout |
infra_error | verifier_error | cancelled, which is never scored and is rerun on resume) is
`tasks.harbor.outcome_of` its exception and reward, the rule readers of any job dir use;
what it scored is `TrialResult.score`. The container (or host workspace) is always removed:
with `TrialEnv.close_in_background` after result.json is written, on a thread of its own
(`wait_for_closes` returns once every such removal is done; a job waits before it ends).
"""

from __future__ import annotations

import atexit
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tmax.tasks import harbor
from tmax.common.files import write_json_atomic
from tmax.tasks.harbor import CANCELLED_ERROR, TrialResult
from tmax.sandbox.base import SandboxError
from tmax.sandbox.pool import SandboxPool
from tmax.tasks.episode import ENVIRONMENT_ERRORS, EnvSettings, Episode, episode_name, resolve_environment
from tmax.tasks.task_format import Task
from tmax.tasks.runners import AgentRun, TrialAgent
from tmax.tasks.task_images import TaskImage
from tmax.tasks.verifier import VerifierKind

# A verifier that ran but gave no reward, as Harbor's exception types name it.
HARBOR_VERIFIER_ERRORS = {
    VerifierKind.TIMEOUT: "VerifierTimeoutError",
    VerifierKind.NO_REWARD: "RewardFileNotFoundError",
    VerifierKind.EMPTY_REWARD: "RewardFileEmptyError",
    VerifierKind.PARSE_ERROR: "VerifierOutputParseError",
    VerifierKind.SETUP_FAILED: "VerifierError",
}
TRIAL_LABEL = "io.tmax.trial"
JOB_LABEL = "io.tmax.job"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class TrialPlan:
    task: Task
    attempt: int
    trial_name: str
    trial_dir: Path
    job_name: str = ""
    config: harbor.TrialConfig = field(default_factory=harbor.TrialConfig)  # the trial's config.json


@dataclass
class TrialEnv:
    """Everything a trial needs besides its plan; shared by all trials of a job."""

    agent: TrialAgent
    env: EnvSettings  # the environment every trial's episode gets (`tasks.episode`)
    timeout_multiplier: float = 1.0
    cancel: threading.Event = field(default_factory=threading.Event)
    # Called with each live sandbox (and None when it is closed) so Ctrl-C can close them.
    on_sandbox: Callable[[str, Any], None] | None = None
    model_name: str | None = None
    # Remove the container after result.json is written, off the trial's critical path.
    close_in_background: bool = False
    # podman: the `sandbox.pool.SandboxPool` trials take their containers from, where
    # `prewarm_trial` started one ahead for them (None: each trial starts its own), and the
    # task images resolved meanwhile (task name -> `tasks.task_images.TaskImage`).
    pool: SandboxPool | None = None
    images: dict[str, TaskImage | None] = field(default_factory=dict)


_closing: set[threading.Thread] = set()
_closing_lock = threading.Lock()


def _close_later(episode: Episode) -> None:
    def work() -> None:
        try:
            episode.close()
        finally:
            with _closing_lock:
                _closing.discard(threading.current_thread())

    th = threading.Thread(target=work, daemon=True, name="tmax-trial-close")
    with _closing_lock:
        _closing.add(th)
    th.start()


def wait_for_closes() -> None:
    """Return once every container handed to a background close is removed."""
    while True:
        with _closing_lock:
            pending = list(_closing)
        if not pending:
            return
        for th in pending:
            th.join()


atexit.register(wait_for_closes)  # nothing is left behind when the process ends


class _Phase:
    def __init__(self, times: dict, name: str):
        self.times, self.name = times, name

    def __enter__(self):
        self.times[self.name] = {"started_at": now_iso(), "finished_at": None}
        self.t0 = time.monotonic()

    def __exit__(self, *exc):
        self.times[self.name]["finished_at"] = now_iso()
        self.times[self.name]["duration_s"] = round(time.monotonic() - self.t0, 3)


def _exception(kind: str, message: str, tb: str | None = None) -> harbor.ExceptionInfo:
    return harbor.ExceptionInfo(exception_type=kind, exception_message=message, exception_traceback=tb or "",
                                occurred_at=now_iso())


@dataclass
class _TrialRun:
    """What a trial found out so far (result.json is made from it)."""

    times: dict[str, dict] = field(default_factory=dict)
    started: str = field(default_factory=now_iso)
    reward: float | None = None
    exc: harbor.ExceptionInfo | None = None
    agent_run: AgentRun | None = None
    verifier_status: str | None = None
    verifier_s: float | None = None
    sandbox_mode: str | None = None  # `Episode.sandbox_mode`, once the sandbox started

    def fail(self, cancel: threading.Event, e: Exception, message: str) -> None:
        """An exception ended the trial: the interrupt when the job was cancelled, else an
        infrastructure error (never the agent's); neither carries a reward."""
        self.reward = None
        if cancel.is_set():
            self.exc = _exception(CANCELLED_ERROR, "the job was interrupted")
        else:
            self.exc = _exception(type(e).__name__, message, traceback.format_exc())


def _episode(plan: TrialPlan, env: TrialEnv) -> Episode:
    labels = {JOB_LABEL: plan.job_name, TRIAL_LABEL: plan.trial_name}
    on_sandbox = (lambda sb: env.on_sandbox(plan.trial_name, sb)) if env.on_sandbox else None
    return Episode(plan.task, env.env, name=episode_name(plan.trial_name), labels=labels, on_sandbox=on_sandbox,
                   cancel=env.cancel, shell=env.agent.uses_shell, image=env.images.get(plan.task.name),
                   pool=env.pool)


def prewarm_trial(plan: TrialPlan, env: TrialEnv) -> bool:
    """Start the container of a trial yet to begin in `env.pool` (its image resolved first,
    once per task); False when there is no pool, no room or no image: a problem with the
    environment is then met, and reported, by the trial itself."""
    if env.pool is None or env.cancel.is_set():
        return False
    episode = _episode(plan, env)
    if episode.image is None:
        try:
            episode.image = resolve_environment(plan.task, episode.settings, env.cancel)
        except Exception:
            return False
        env.images[plan.task.name] = episode.image
    return episode.prewarm()


def run_trial(plan: TrialPlan, env: TrialEnv) -> TrialResult:
    """Run one trial to its end and return its result (also written to result.json)."""
    plan.trial_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan.trial_dir / "config.json", plan.config.dump())
    run = _TrialRun()
    episode = _episode(plan, env)
    try:
        _run_phases(plan, env, episode, run)
    except _Cancelled:
        run.reward, run.exc = None, _exception(CANCELLED_ERROR, "the job was interrupted")
    except (*ENVIRONMENT_ERRORS, SandboxError, OSError) as e:
        run.fail(env.cancel, e, str(e))
    except Exception as e:  # a harness bug: still an infrastructure error, never the agent's
        run.fail(env.cancel, e, f"internal error: {e}")
    except BaseException:  # KeyboardInterrupt, SystemExit: no result, the container goes now
        episode.close()
        raise
    finally:
        image = episode.image
        if not env.close_in_background:
            episode.close()
    try:
        if run.exc and run.exc.exception_traceback:
            (plan.trial_dir / "exception.txt").write_text(run.exc.exception_traceback)
        result = _result(plan, env, run, image)
        write_json_atomic(plan.trial_dir / "result.json", result.dump())
    finally:
        if env.close_in_background:
            _close_later(episode)
    return result


def _run_phases(plan: TrialPlan, env: TrialEnv, episode: Episode, run: _TrialRun) -> None:
    """Environment, agent, verifier; `run` gets the reward and the exception that describe
    how the trial ended. Raises _Cancelled on an interrupt."""
    task, mult = plan.task, env.timeout_multiplier

    def check_cancel() -> None:
        if env.cancel.is_set():
            raise _Cancelled()

    with _Phase(run.times, "environment_setup"):
        check_cancel()
        sandbox = episode.open()
        workdir = episode.workdir
        run.sandbox_mode = episode.sandbox_mode
    check_cancel()
    with _Phase(run.times, "agent_execution"):
        agent_run = run.agent_run = env.agent.run(sandbox, task, workdir, plan.trial_dir / "agent",
                                                  task.config.agent.timeout_sec * mult, env.cancel)
    check_cancel()
    if agent_run.timed_out:
        run.exc = _exception("AgentTimeoutError",
                             f"Agent execution timed out after {task.config.agent.timeout_sec * mult:.1f} seconds")
    elif agent_run.error:
        run.exc = _exception("AgentError", agent_run.error)
    # As in Harbor, the verifier runs even after an agent timeout.
    with _Phase(run.times, "verifier"):
        vr = episode.verify(plan.trial_dir / "verifier", task.config.verifier.timeout_sec * mult)
    check_cancel()
    run.verifier_status, run.verifier_s, run.reward = vr.kind.value, round(vr.duration_s, 3), vr.reward
    if vr.kind == VerifierKind.INFRA:  # an infrastructure error: no reward
        run.reward, run.exc = None, _exception("SandboxError", vr.error or "the verifier could not run")
    elif vr.kind != VerifierKind.OK:
        run.exc = _exception(HARBOR_VERIFIER_ERRORS[vr.kind], vr.error or "verifier failed")
    # else: the reward counts whether or not the agent timed out (run.exc says it did)


def _result(plan: TrialPlan, env: TrialEnv, run: _TrialRun, image: TaskImage | None) -> TrialResult:
    """result.json: Harbor's fields, and tmax's own under "tmax"."""
    task, agent_run, reward, cfg = plan.task, run.agent_run, run.reward, plan.config
    model = harbor.ModelInfo(name=env.model_name, provider="openai") if env.model_name else None
    return TrialResult(
        id=str(uuid.uuid4()), task_name=task.name, trial_name=plan.trial_name,
        trial_uri=plan.trial_dir.resolve().as_uri(), task_id=harbor.TaskId(path=str(task.path)),
        source=cfg.task.source if cfg.task else None, task_checksum=cfg.task.checksum if cfg.task else None,
        config=cfg,
        agent_info=harbor.AgentInfo(name=env.agent.name, version=env.agent.version, model_info=model),
        agent_result=harbor.AgentContext(
            n_input_tokens=agent_run.n_input_tokens if agent_run else 0, n_cache_tokens=0,
            n_output_tokens=agent_run.n_output_tokens if agent_run else 0, cost_usd=None,
            metadata=agent_run.metadata if agent_run else {}),
        verifier_result=harbor.VerifierResult(rewards={"reward": reward}) if reward is not None else None,
        exception_info=run.exc,
        started_at=run.started, finished_at=now_iso(),
        **{k: harbor.TimingInfo(**run.times[k]) if k in run.times else None
           for k in ("environment_setup", "agent_setup", "agent_execution", "verifier")},
        tmax=harbor.TmaxTrial(
            outcome=harbor.outcome_of(run.exc.exception_type if run.exc else None, reward),
            environment=env.env.kind, reward=reward, attempt=plan.attempt, category=task.category,
            image=image.tag if image else None, image_built=image.built if image else None,
            build_s=image.build_s if image else None,
            build_log=str(image.log_path) if image and image.log_path else None, sandbox_mode=run.sandbox_mode,
            verifier_status=run.verifier_status, verifier_s=run.verifier_s),
    )


class _Cancelled(Exception):
    pass
