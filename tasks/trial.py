"""One trial: an episode (`tasks.episode`: image -> container -> agent -> verifier) and
its outcome, in a Harbor trial dir. On the host sandboxes (bwrap, local) a fresh
workspace stands in for the image and the verifier runs from a per-trial copy of tests/.

    <trial>/config.json           what was run (written first)
    <trial>/result.json           reward, timings, exception info (written last, atomically)
    <trial>/agent/                trajectory.json etc. (tmax), oracle.txt (oracle)
    <trial>/verifier/             reward.txt, test-stdout.txt, ctrf.json
    <trial>/exception.txt         the traceback when something went wrong

Outcomes: pass | fail | agent_timeout | infra_error | verifier_error (| cancelled, which
is never scored and is rerun on resume). The container (or host workspace) is always removed.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from sandbox.base import SandboxError
from tasks.episode import ENVIRONMENT_ERRORS, EnvSettings, Episode, episode_name
from tasks.model import Task
from tasks.offline import RewriteConfig
from tasks.runners import TrialAgent
from tasks.scoring import SUCCESS

CANCELLED = "cancelled"
TRIAL_LABEL = "io.tmax.trial"
JOB_LABEL = "io.tmax.job"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def write_json(path: Path, data: Any) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


@dataclass
class TrialPlan:
    task: Task
    attempt: int
    trial_name: str
    trial_dir: Path
    job_name: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the trial's config.json


@dataclass
class TrialEnv:
    """Everything a trial needs besides its plan; shared by all trials of a job."""

    agent: TrialAgent
    rewrite: RewriteConfig
    timeout_multiplier: float = 1.0
    use_prebuilt: bool = True
    sandbox_kind: str = "podman"
    override_cpus: float | None = None
    override_memory_mb: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    # Called with each live sandbox (and None when it is closed) so Ctrl-C can close them.
    on_sandbox: Callable[[str, Any], None] | None = None
    model_name: str | None = None


class _Phase:
    def __init__(self, times: dict, name: str):
        self.times, self.name = times, name

    def __enter__(self):
        self.times[self.name] = {"started_at": now_iso(), "finished_at": None}
        self.t0 = time.monotonic()

    def __exit__(self, *exc):
        self.times[self.name]["finished_at"] = now_iso()
        self.times[self.name]["duration_s"] = round(time.monotonic() - self.t0, 3)


def _exception(kind: str, message: str, tb: str | None = None) -> dict:
    return {"exception_type": kind, "exception_message": message, "exception_traceback": tb or "",
            "occurred_at": now_iso()}


def run_trial(plan: TrialPlan, env: TrialEnv) -> dict:
    """Run one trial to its end and return result.json's content (also written to disk)."""
    task = plan.task
    plan.trial_dir.mkdir(parents=True, exist_ok=True)
    write_json(plan.trial_dir / "config.json", plan.config)
    times: dict[str, dict] = {}
    started = now_iso()
    reward: float | None = None
    exc: dict | None = None
    outcome: str | None = None
    agent_run = None
    verifier_status = None
    verifier_s = None
    settings = EnvSettings(env.sandbox_kind, env.rewrite, env.use_prebuilt, env.override_cpus,
                           env.override_memory_mb)
    labels = {JOB_LABEL: plan.job_name, TRIAL_LABEL: plan.trial_name}
    on_sandbox = (lambda sb: env.on_sandbox(plan.trial_name, sb)) if env.on_sandbox else None
    episode = Episode(task, settings, name=episode_name(plan.trial_name), labels=labels, on_sandbox=on_sandbox,
                      cancel=env.cancel)
    mult = env.timeout_multiplier
    try:
        with _Phase(times, "environment_setup"):
            if env.cancel.is_set():
                raise _Cancelled()
            sandbox = episode.open()
            workdir = episode.workdir
        if env.cancel.is_set():
            raise _Cancelled()
        with _Phase(times, "agent_execution"):
            agent_run = env.agent.run(sandbox, task, workdir, plan.trial_dir / "agent",
                                      task.config.agent.timeout_sec * mult, env.cancel)
        if env.cancel.is_set():
            raise _Cancelled()
        if agent_run.timed_out:
            exc = _exception("AgentTimeoutError",
                             f"Agent execution timed out after {task.config.agent.timeout_sec * mult:.1f} seconds")
        elif agent_run.error:
            exc = _exception("AgentError", agent_run.error)
        # As in Harbor, the verifier runs even after an agent timeout.
        with _Phase(times, "verifier"):
            vr = episode.verify(plan.trial_dir / "verifier", task.config.verifier.timeout_sec * mult)
        if env.cancel.is_set():
            raise _Cancelled()
        verifier_status = vr.status
        verifier_s = round(vr.duration_s, 3)
        reward = vr.reward
        if vr.status == "timeout":
            exc = _exception("VerifierTimeoutError", vr.error or "verifier timed out")
            outcome = "verifier_error"
        elif vr.status == "error":
            kind = "RewardFileNotFoundError" if "reward.txt or reward.json was written" in (vr.error or "") \
                else "VerifierError"
            exc = _exception(kind, vr.error or "verifier failed")
            outcome = "verifier_error"
        elif agent_run.timed_out:
            outcome = "agent_timeout"
        else:
            outcome = "pass" if reward is not None and reward >= SUCCESS else "fail"
    except _Cancelled:
        outcome, exc = CANCELLED, _exception("CancelledError", "the job was interrupted")
    except (*ENVIRONMENT_ERRORS, SandboxError, OSError) as e:
        if env.cancel.is_set():
            outcome, exc = CANCELLED, _exception("CancelledError", "the job was interrupted")
        else:
            outcome = "infra_error"
            exc = _exception(type(e).__name__, str(e), traceback.format_exc())
    except Exception as e:  # a harness bug: still an infrastructure error, never the agent's
        if env.cancel.is_set():
            outcome, exc = CANCELLED, _exception("CancelledError", "the job was interrupted")
        else:
            outcome = "infra_error"
            exc = _exception(type(e).__name__, f"internal error: {e}", traceback.format_exc())
    finally:
        image = episode.image
        episode.close()
    if outcome != "pass" and outcome != "fail" and outcome not in ("agent_timeout", "verifier_error"):
        reward = None  # infra errors and cancellations carry no reward
    if exc and exc.get("exception_traceback"):
        (plan.trial_dir / "exception.txt").write_text(exc["exception_traceback"])
    result = {
        "id": str(uuid.uuid4()),
        "task_name": task.name,
        "trial_name": plan.trial_name,
        "trial_uri": plan.trial_dir.resolve().as_uri(),
        "task_id": {"path": str(task.path)},
        "source": plan.config.get("task", {}).get("source"),
        "task_checksum": plan.config.get("task", {}).get("checksum"),
        "config": plan.config,
        "agent_info": {"name": env.agent.name, "version": env.agent.version,
                       "model_info": {"name": env.model_name, "provider": "openai"} if env.model_name else None},
        "agent_result": {
            "n_input_tokens": agent_run.n_input_tokens if agent_run else 0,
            "n_cache_tokens": 0,
            "n_output_tokens": agent_run.n_output_tokens if agent_run else 0,
            "cost_usd": None,
            "metadata": agent_run.metadata if agent_run else {},
        },
        "verifier_result": {"rewards": {"reward": reward}} if reward is not None else None,
        "exception_info": exc,
        "started_at": started,
        "finished_at": now_iso(),
        **{k: times.get(k) for k in ("environment_setup", "agent_setup", "agent_execution", "verifier")},
        "tmax": {
            "outcome": outcome,
            "environment": env.sandbox_kind,
            "reward": reward,
            "attempt": plan.attempt,
            "category": task.category,
            "image": image.tag if image else None,
            "image_built": image.built if image else None,
            "build_s": image.build_s if image else None,
            "build_log": str(image.log_path) if image and image.log_path else None,
            "verifier_status": verifier_status,
            "verifier_s": verifier_s,
        },
    }
    write_json(plan.trial_dir / "result.json", result)
    return result


class _Cancelled(Exception):
    pass
