"""A job: tasks x attempts, run concurrently, in a Harbor-compatible job directory.

    <jobs_dir>/<job_name>/config.json    the job's config (and its identity)
    <jobs_dir>/<job_name>/result.json    live stats + scores, rewritten after every trial
    <jobs_dir>/<job_name>/<task>__<id>/  one directory per trial (see tasks.trial)

Resume: the trial names are derived from the job identity, the task and the attempt
number, so rerunning the same job (same name, or `tmax bench resume`) finds the trials
that already have a result and runs only the others. The identity leaves out volatile
things (endpoint URL, concurrency, output paths), so a new vLLM port does not throw
finished trials away. Cancelled trials and, with `retry_infra`, infrastructure errors
are rerun; an old attempt is moved to `.retries/`, never silently deleted.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field, field_validator

from tmax.common.files import read_json, write_json_atomic
from tmax.sandbox.base import KINDS
from tmax.tasks.dataset import load_tasks
from tmax.tasks.model import Task
from tmax.tasks.offline import default_config
from tmax.tasks.runners import make_agent
from tmax.tasks.scoring import score
from tmax.tasks.trial import (
    CANCELLED, JOB_LABEL, TrialEnv, TrialPlan, now_iso, prewarm_trial, run_trial, wait_for_closes,
)

# Fields that do not change what a trial means; they stay out of the identity.
VOLATILE = {"base_url", "n_concurrent", "jobs_dir", "job_name", "created_at", "retry_infra", "api_key_env",
            "warm_ahead", "overlay"}


class JobError(ValueError):
    pass


class JobConfig(BaseModel):
    job_name: str
    jobs_dir: str
    dataset: str  # as given: a path or name@version
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    limit: int | None = None
    agent: str = "oracle"
    model: str | None = None
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"  # the key itself is never written to disk
    agent_kwargs: dict[str, Any] = Field(default_factory=dict)
    n_attempts: int = Field(1, ge=1)
    n_concurrent: int = Field(1, ge=1)
    timeout_multiplier: float = Field(1.0, gt=0)
    image_map: list[str] = Field(default_factory=list)
    use_prebuilt: bool = True
    override_cpus: float | None = None
    override_memory_mb: int | None = None
    # Where trials run: podman containers, or the host sandboxes (`tasks.hostenv`).
    environment: str = "podman"
    # podman: containers started ahead for the trials next in line, beyond the running ones
    # (0: each trial starts its own when it begins).
    warm_ahead: int = Field(0, ge=0)
    # podman: each trial a fresh overlay of a container its task's trials share
    # (`sandbox.overlay_pool`); False: a fresh container per trial.
    overlay: bool = True
    created_at: str | None = None

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, v: str) -> str:
        if v not in KINDS:
            raise ValueError(f"unknown environment {v!r}: choose one of {', '.join(KINDS)}")
        return v

    def identity(self, task_checksums: dict[str, str]) -> str:
        data = {k: v for k, v in self.model_dump().items() if k not in VOLATILE}
        if data.get("environment") == "podman":
            del data["environment"]  # jobs from before the field existed keep their identity
        data["dataset"] = None  # where the tasks live does not matter, what they contain does
        data["tasks"] = task_checksums
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def harbor_environment(kind: str) -> dict[str, str | None]:
    """Harbor knows podman by type; the host sandboxes are named by where they live."""
    if kind == "podman":
        return {"type": "podman"}
    return {"type": None, "import_path": f"tmax.sandbox.{kind}", "kind": kind}


def dataset_source(dataset: str) -> str | None:
    """What Harbor records as a trial's `source`: a dataset directory's name, a registry
    dataset's name, nothing for a single task directory."""
    path = Path(dataset).expanduser()
    if path.exists():
        return None if (path / "task.toml").is_file() else path.resolve().name
    return dataset.split("@", 1)[0]


def trial_name(identity: str, task: str, attempt: int) -> str:
    return f"{task}__{hashlib.sha256(f'{identity}/{task}/{attempt}'.encode()).hexdigest()[:7]}"


@dataclass
class Progress:
    total: int
    done: int = 0
    running: int = 0
    skipped: int = 0  # already finished before this run (resume)
    passed: int = 0
    reward_sum: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    trial_seconds: list[float] = field(default_factory=list)

    @property
    def queued(self) -> int:
        return self.total - self.done - self.running

    @property
    def pass_rate(self) -> float | None:
        return self.reward_sum / self.done if self.done else None

    def eta_s(self, n_concurrent: int) -> float | None:
        if not self.trial_seconds:
            return None
        avg = sum(self.trial_seconds) / len(self.trial_seconds)
        return avg * (self.queued + self.running / 2) / max(1, n_concurrent)


ProgressFn = Callable[[str, Progress, dict | None], None]



class Job:
    def __init__(self, config: JobConfig, api_key: str | None = None, sandbox_kind: str | None = None):
        if sandbox_kind is not None and sandbox_kind != config.environment:
            raise JobError(f"sandbox_kind={sandbox_kind!r} contradicts JobConfig.environment="
                           f"{config.environment!r}; set JobConfig.environment only")
        self.config = config
        self.dir = Path(config.jobs_dir).expanduser() / config.job_name
        self.api_key = api_key
        self.sandbox_kind = config.environment
        self.tasks: list[Task] = load_tasks(config.dataset, config.include or None, config.exclude or None,
                                            config.limit)
        self.checksums = {t.name: t.checksum() for t in self.tasks}
        self.identity = config.identity(self.checksums)
        # Harbor's job id is a UUID: this one is derived from the identity, so it is stable on resume.
        self.job_id = str(uuid.UUID(self.identity[:32]))
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._sandboxes: dict[str, Any] = {}
        self._pool: Any = None  # the warm pool of a running job (`_warm_pool`)
        self.rewrite = default_config(config.image_map)
        self.agent = make_agent(config.agent, self.rewrite, config.model, config.base_url, api_key,
                                config.agent_kwargs)
        self._plans: list[TrialPlan] | None = None  # made once (`plans`): the job rescores after every trial

    # --- the job directory -------------------------------------------------------------
    @classmethod
    def open(cls, job_dir: Path, **overrides: Any) -> "Job":
        """Reopen an existing job (for `tmax bench resume`), optionally with a new endpoint."""
        data = read_json(job_dir / "config.json")
        if data is None:
            raise JobError(f"{job_dir}: not a job directory (no readable config.json)")
        cfg = dict(data.get("tmax_job") or {})
        if not cfg:
            raise JobError(f"{job_dir}/config.json was not written by tmax bench (a Harbor job resumes with "
                           "`harbor job resume`; report and compare read it as it is)")
        env = overrides.get("environment")
        if env is not None and env != cfg.get("environment", "podman"):
            raise JobError(f"{job_dir} runs its trials with -e {cfg.get('environment', 'podman')}, not {env}: the "
                           "environment is part of a job's identity (start a new job to use another)")
        cfg.update({k: v for k, v in overrides.items() if v is not None})
        cfg["jobs_dir"] = str(job_dir.parent)
        cfg["job_name"] = job_dir.name
        api_key = overrides.pop("api_key", None)
        cfg.pop("api_key", None)
        return cls(JobConfig(**cfg), api_key=api_key)

    def plans(self) -> list[TrialPlan]:
        if self._plans is None:
            self._plans = self._make_plans()
        return list(self._plans)

    def _make_plans(self) -> list[TrialPlan]:
        out = []
        source = dataset_source(self.config.dataset)
        for task in self.tasks:
            for attempt in range(self.config.n_attempts):
                name = trial_name(self.identity, task.name, attempt)
                cfg = {
                    # Harbor's TaskConfig takes a path or a registry name, never both.
                    "task": {"path": str(task.path), "source": source,
                             "checksum": self.checksums[task.name]},
                    "trial_name": name,
                    "trials_dir": str(self.dir),
                    "attempt": attempt,
                    "timeout_multiplier": self.config.timeout_multiplier,
                    "agent": {"name": self.config.agent, "model_name": self.config.model,
                              "kwargs": self.config.agent_kwargs},
                    "environment": {**harbor_environment(self.sandbox_kind), "image_map": self.config.image_map,
                                    "delete": True},
                    "verifier": {"offline_rewrite": True},
                    "job_id": self.job_id,
                }
                out.append(TrialPlan(task, attempt, name, self.dir / name, self.config.job_name, cfg))
        return out

    def _write_config(self) -> None:
        existing = read_json(self.dir / "config.json")
        if existing is not None:
            if existing.get("tmax_identity") != self.identity:
                raise JobError(
                    f"job {self.dir} already exists with a different configuration (agent, model, tasks, "
                    f"attempts or task contents differ). Use another --job-name, or `tmax bench resume "
                    f"{self.dir}` to continue it as it was.")
            created = existing.get("tmax_job", {}).get("created_at")
        else:
            created = now_iso()
        self.config.created_at = created
        cfg = self.config.model_dump()
        write_json_atomic(self.dir / "config.json", {
            "job_name": self.config.job_name,
            "jobs_dir": self.config.jobs_dir,
            "n_attempts": self.config.n_attempts,
            "n_concurrent_trials": self.config.n_concurrent,
            "timeout_multiplier": self.config.timeout_multiplier,
            "agents": [{"name": self.config.agent, "model_name": self.config.model,
                        "kwargs": {**self.config.agent_kwargs,
                                   **({"api_base": self.config.base_url} if self.config.base_url else {})}}],
            "datasets": [{"path": self.config.dataset}],
            "environment": {**harbor_environment(self.sandbox_kind), "delete": True},
            "tmax_identity": self.identity,
            "tmax_job": cfg,
        })

    def results(self) -> list[dict]:
        """Finished trials of this job's plan (cancelled ones are not finished)."""
        out = []
        for p in self.plans():
            r = read_json(p.trial_dir / "result.json")
            if r and r.get("tmax", {}).get("outcome") not in (None, CANCELLED):
                out.append(r)
        return out

    def write_result(self, progress: Progress | None = None, finished: bool = False) -> dict:
        plans = self.plans()
        results = []
        n_cancelled = 0
        for p in plans:
            r = read_json(p.trial_dir / "result.json")
            if r is None:
                continue
            if r.get("tmax", {}).get("outcome") == CANCELLED:
                n_cancelled += 1
            else:
                results.append(r)
        # The interval once the job has finished: not after every trial (see `score`).
        sc = score([trial_row(r) for r in results], interval=finished) if results else None
        running = progress.running if progress else 0
        existing = read_json(self.dir / "result.json") or {}
        n_errored = sum(1 for r in results if r.get("exception_info"))
        tokens = {k: sum(int((r.get("agent_result") or {}).get(k) or 0) for r in results)
                  for k in ("n_input_tokens", "n_cache_tokens", "n_output_tokens")}
        # Harbor 0.26's JobResult: counts, scores and tokens all under "stats".
        data = {
            "schema_version": 1,
            "id": self.job_id,
            "started_at": existing.get("started_at") or now_iso(),
            "updated_at": now_iso(),
            "finished_at": now_iso() if finished else None,
            "n_total_trials": len(plans),
            "stats": {
                "n_completed_trials": len(results),
                "n_errored_trials": n_errored,
                "n_running_trials": running,
                "n_pending_trials": max(0, len(plans) - len(results) - running),
                "n_cancelled_trials": n_cancelled,
                "n_retries": len(list((self.dir / ".retries").glob("*"))) if (self.dir / ".retries").is_dir() else 0,
                "evals": {self._evals_key(): _eval_stats(results, sc)} if results else {},
                **tokens,
                "cost_usd": None,
            },
            "trial_results": [],
            "tmax_score": sc.to_dict() if sc else None,
        }
        write_json_atomic(self.dir / "result.json", data)
        return data

    def _evals_key(self) -> str:
        """The key Harbor gives this job's scores: agent, model and the trials' source."""
        name, model = self.agent.name, self.config.model
        source = dataset_source(self.config.dataset) or "adhoc"
        return f"{name}__{model}__{source}" if model else f"{name}__{source}"

    # --- running -------------------------------------------------------------------------
    def pending(self, retry_infra: bool = False) -> tuple[list[TrialPlan], int]:
        """Trials still to run, and how many are already done."""
        todo, done = [], 0
        for p in self.plans():
            r = read_json(p.trial_dir / "result.json")
            outcome = (r or {}).get("tmax", {}).get("outcome")
            if r is not None and outcome != CANCELLED and not (retry_infra and outcome == "infra_error"):
                done += 1
                continue
            if p.trial_dir.exists():
                if outcome == "infra_error":
                    dst = self.dir / ".retries" / f"{p.trial_name}.{int(time.time() * 1000)}"
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    p.trial_dir.rename(dst)
                else:  # cancelled or never finished: a partial directory, start afresh
                    shutil.rmtree(p.trial_dir, ignore_errors=True)
            todo.append(p)
        return todo, done

    def _on_sandbox(self, name: str, sb: Any) -> None:
        with self._lock:
            if sb is None:
                self._sandboxes.pop(name, None)
            else:
                self._sandboxes[name] = sb
        if sb is not None and self.cancel.is_set():
            _close_quietly(sb)

    def run(self, progress_fn: ProgressFn | None = None, retry_infra: bool = False) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        todo, done = self.pending(retry_infra)
        prog = Progress(total=len(todo) + done, done=done, skipped=done)
        for r in self.results():
            _count(prog, r)
        self.write_result(prog)
        if todo and self.sandbox_kind == "podman":
            from tmax.sandbox.podman_service import prestart

            prestart()  # the REST service starts while the first trial looks up its image
        env = TrialEnv(agent=self.agent, rewrite=self.rewrite, timeout_multiplier=self.config.timeout_multiplier,
                       use_prebuilt=self.config.use_prebuilt, sandbox_kind=self.sandbox_kind,
                       override_cpus=self.config.override_cpus, override_memory_mb=self.config.override_memory_mb,
                       cancel=self.cancel, on_sandbox=self._on_sandbox, model_name=self.config.model,
                       close_in_background=True, pool=self._warm_pool())
        emit = progress_fn or (lambda *a: None)
        emit("start", prog, None)
        ahead = _Ahead(todo, self.config.n_concurrent, self.config.warm_ahead)

        def one(plan: TrialPlan) -> dict:
            if self.cancel.is_set():
                return {}
            for later in ahead.claim(plan):
                if not prewarm_trial(later, env):
                    ahead.unclaim(later)  # no room now: a trial starting later tries again
            with self._lock:
                prog.running += 1
            emit("trial_start", prog, {"trial_name": plan.trial_name, "task": plan.task.name})
            t0 = time.monotonic()
            try:
                return run_trial(plan, env)
            finally:
                with self._lock:
                    prog.running -= 1
                    prog.trial_seconds.append(time.monotonic() - t0)

        pool = ThreadPoolExecutor(max_workers=self.config.n_concurrent, thread_name_prefix="tmax-trial")
        futures: set[Future] = {pool.submit(one, p) for p in todo}
        try:
            while futures:
                finished, futures = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
                for f in finished:
                    r = f.result()
                    if not r or r.get("tmax", {}).get("outcome") == CANCELLED:
                        continue
                    with self._lock:
                        prog.done += 1
                        _count(prog, r)
                        self.write_result(prog)
                    emit("trial_end", prog, r)
        except KeyboardInterrupt:
            self.interrupt()
            pool.shutdown(wait=True, cancel_futures=True)
            self.write_result(prog)
            wait_for_closes()
            emit("cancelled", prog, None)
            raise
        pool.shutdown(wait=True)
        data = self.write_result(prog, finished=True)
        wait_for_closes()  # every container of the job is gone when it ends
        if env.pool is not None:
            env.pool.close()
        emit("end", prog, None)
        return data

    def interrupt(self) -> None:
        """Stop: no new trials; running ones are cancelled and their containers removed."""
        self.cancel.set()
        with self._lock:
            live = list(self._sandboxes.values())
            warm = self._pool
        for sb in live:
            _close_quietly(sb)
        if warm is not None:
            warm.close(in_use=True)

    def _warm_pool(self) -> Any:
        """The job's pool (podman): trials as overlays of shared containers (`overlay`), else
        containers started ahead (`warm_ahead`), else None."""
        pool = None
        if self.sandbox_kind == "podman" and self.config.overlay:
            from tmax.sandbox.overlay_pool import OverlayPool

            pool = OverlayPool(self.config.n_concurrent, self.config.warm_ahead,
                               host_labels={JOB_LABEL: self.config.job_name})
        elif self.sandbox_kind == "podman" and self.config.warm_ahead:
            from tmax.sandbox.pool import WarmPool

            pool = WarmPool(self.config.n_concurrent + self.config.warm_ahead)
        with self._lock:
            self._pool = pool
        return pool


def _eval_stats(results: list[dict], sc: Any) -> dict:
    """Harbor's AgentDatasetStats for one agent on one dataset: the mean (errors count 0)
    and pass@k, the trials by reward and by exception."""
    reward_stats: dict[str, list[str]] = {}
    exc_stats: dict[str, list[str]] = {}
    for r in results:
        rw = ((r.get("verifier_result") or {}).get("rewards") or {}).get("reward")
        if rw is not None:
            reward_stats.setdefault(str(float(rw)), []).append(r["trial_name"])
        if r.get("exception_info"):
            exc_stats.setdefault(r["exception_info"]["exception_type"], []).append(r["trial_name"])
    return {
        "n_trials": sum(len(v) for v in reward_stats.values()),
        "n_errors": sum(1 for r in results if r.get("exception_info")),
        "metrics": [{"mean": sc.mean_reward}],
        "pass_at_k": {str(k): v for k, v in sc.pass_at_k.items()},
        "reward_stats": {"reward": reward_stats},
        "exception_stats": exc_stats,
    }


class _Ahead:
    """Which trials a starting trial starts containers for: the `warm` next in line (the
    executor takes trials in order, the first `running` at once), each claimed once; a
    claim whose start found no room is given back for a later trial to retry."""

    def __init__(self, todo: list[TrialPlan], running: int, warm: int):
        self.todo, self.running, self.warm = todo, running, warm
        self.index = {p.trial_name: i for i, p in enumerate(todo)}
        self.claimed: set[int] = set()
        self.lock = threading.Lock()

    def claim(self, plan: TrialPlan) -> list[TrialPlan]:
        first = max(self.index[plan.trial_name] + 1, self.running)
        with self.lock:
            picked = [j for j in range(first, min(first + self.warm, len(self.todo))) if j not in self.claimed]
            self.claimed.update(picked)
        return [self.todo[j] for j in picked]

    def unclaim(self, plan: TrialPlan) -> None:
        with self.lock:
            self.claimed.discard(self.index[plan.trial_name])


def _close_quietly(sb: Any) -> None:
    try:
        sb.close()
    except Exception:
        pass


def _count(prog: Progress, r: dict) -> None:
    t = r.get("tmax", {})
    prog.outcomes[t.get("outcome")] = prog.outcomes.get(t.get("outcome"), 0) + 1
    prog.reward_sum += float(t.get("reward") or 0.0)
    if t.get("outcome") == "pass":
        prog.passed += 1


def trial_row(r: dict) -> dict:
    t = r.get("tmax", {})
    return {"task": r["task_name"], "trial": r["trial_name"], "outcome": t.get("outcome"),
            "reward": t.get("reward"), "category": t.get("category"), "attempt": t.get("attempt")}
