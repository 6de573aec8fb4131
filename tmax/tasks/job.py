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

Every file is read and written as its typed record (`tasks.harbor`), and what a trial
scored is `TrialResult.score`, for progress, the job's scores and resume alike.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable

from pydantic import BaseModel, Field, field_validator

from tmax.agents.agent_settings import AgentSettings, renamed_keys
from tmax.tasks import harbor
from tmax.common.files import read_json, write_json_atomic
from tmax.tasks.harbor import CANCELLED, INFRA_ERROR, TrialResult
from tmax.sandbox import sandbox_class
from tmax.sandbox.base import KINDS, Sandbox
from tmax.sandbox.pool import SandboxPool, WarmAhead
from tmax.sandbox.pool_factory import make_pool
from tmax.tasks.dataset import load_tasks
from tmax.tasks.episode import EnvSettings
from tmax.tasks.job_runner import Finished, JobError, JobItem, JobRunner
from tmax.tasks.task_format import Task
from tmax.tasks.offline import default_config
from tmax.tasks.runners import make_agent
from tmax.tasks.scoring import Score, TrialRow, score
from tmax.tasks.trial import JOB_LABEL, TrialEnv, TrialPlan, now_iso, prewarm_trial, run_trial, wait_for_closes

# Fields that do not change what a trial means; they stay out of the identity.
VOLATILE = {"base_url", "n_concurrent", "jobs_dir", "job_name", "created_at", "retry_infra", "api_key_env",
            "warm_ahead", "overlay"}



class JobSpec(BaseModel):
    """A `tmax bench` job as it runs and as its config.json keeps it (the CLI's
    `cli.bench_settings.BenchSettings` make it); its identity (`identity`) decides whether a
    rerun resumes it."""

    job_name: Annotated[str, Field(description="The job directory's name under `jobs_dir`.")]
    jobs_dir: Annotated[str, Field(description="Where job directories go.")]
    dataset: Annotated[str, Field(description="The tasks, as given: a directory, a task directory or name@version.")]
    include: Annotated[list[str], Field(default_factory=list, description="Only tasks matching these globs.")]
    exclude: Annotated[list[str], Field(default_factory=list, description="Skip tasks matching these globs.")]
    limit: Annotated[int | None, Field(description="At most this many tasks (after include/exclude).")] = None
    agent: Annotated[str, Field(description="A harness (tmax, mini-swe, terminus-2), oracle or nop.")] = "oracle"
    model: Annotated[str | None, Field(description="The model's name at the endpoint (the tmax agent).")] = None
    base_url: Annotated[str | None, Field(description="The OpenAI-compatible endpoint (not part of the identity).")] = None
    api_key_env: Annotated[str, Field(description="The environment variable holding the API key; the key itself "
                                                  "is never written to disk.")] = "OPENAI_API_KEY"
    agent_kwargs: Annotated[dict[str, Any], Field(
        default_factory=dict, description="Agent settings (`agents.agent_settings`: `--ak`, `tmax bench run "
                                          "--config`) as given, under their current names; `agent_settings` types them.")]
    n_attempts: Annotated[int, Field(ge=1, description="Attempts per task (pass@k).")] = 1
    n_concurrent: Annotated[int, Field(ge=1, description="Trials run at once.")] = 1
    timeout_multiplier: Annotated[float, Field(gt=0, description="Scales the agent and verifier timeouts.")] = 1.0
    image_map: Annotated[list[str], Field(default_factory=list, description="Base images re-targeted: FROM=TO "
                                                                             "(FROM may be a glob).")]
    use_prebuilt: Annotated[bool, Field(description="Use a task's docker_image when it can be pulled.")] = True
    override_cpus: Annotated[float | None, Field(description="CPUs per trial instead of the task's.")] = None
    override_memory_mb: Annotated[int | None, Field(description="Memory per trial (MB) instead of the task's.")] = None
    environment: Annotated[str, Field(description="Where trials run: podman containers, or the host sandboxes "
                                                  "bwrap and local (`tasks.hostenv`).")] = "podman"
    warm_ahead: Annotated[int, Field(ge=0, description="podman: containers started ahead for the trials next in "
                                                       "line, beyond the running ones (0: each trial starts its "
                                                       "own when it begins).")] = 0
    overlay: Annotated[bool, Field(description="podman: each trial a fresh overlay of a container its task's "
                                               "trials share (`sandbox.overlay_pool`); False: a fresh container "
                                               "per trial.")] = True
    created_at: Annotated[str | None, Field(description="When the job was first started.")] = None

    @field_validator("agent_kwargs")
    @classmethod
    def _agent_settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        v = renamed_keys(v)
        AgentSettings.from_settings(v)  # a name or value that is no agent setting fails before any trial
        return v

    @property
    def agent_settings(self) -> AgentSettings:
        return AgentSettings.from_settings(self.agent_kwargs)

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


def harbor_environment(kind: str, **extra: Any) -> harbor.EnvironmentConfig:
    """Harbor knows podman by type; the host sandboxes are named by where they live."""
    if kind == "podman":
        return harbor.EnvironmentConfig(type="podman", delete=True, **extra)
    return harbor.EnvironmentConfig(type=None, import_path=f"tmax.sandbox.{kind}", kind=kind, delete=True, **extra)


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


ProgressFn = Callable[[str, Progress, TrialResult | dict | None], None]


def read_job_config(job_dir: Path) -> harbor.JobConfig:
    """A job directory's config.json (tmax's, Harbor's or another agent's)."""
    data = read_json(job_dir / "config.json")
    if data is None:
        raise JobError(f"{job_dir}: not a job directory (no readable config.json)")
    cfg = harbor.JobConfig.parse(data)
    if cfg is None:
        raise JobError(f"{job_dir}/config.json is not a job's config (expected Harbor's JobSpec fields)")
    return cfg



class Job:
    def __init__(self, config: JobSpec, api_key: str | None = None, sandbox_kind: str | None = None):
        if sandbox_kind is not None and sandbox_kind != config.environment:
            raise JobError(f"sandbox_kind={sandbox_kind!r} contradicts JobSpec.environment="
                           f"{config.environment!r}; set JobSpec.environment only")
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
        self._sandboxes: dict[str, Sandbox] = {}
        self._live: _Live | None = None  # what a running job's trials share (`_start_live`)
        self.rewrite = default_config(config.image_map)
        self.agent = make_agent(config.agent, self.rewrite, config.model, config.base_url, api_key,
                                config.agent_settings)
        self._plans: list[TrialPlan] | None = None  # made once (`plans`): the job rescores after every trial

    # --- the job directory -------------------------------------------------------------
    @classmethod
    def open(cls, job_dir: Path, **overrides: Any) -> "Job":
        """Reopen an existing job (for `tmax bench resume`), optionally with a new endpoint."""
        stored = read_job_config(job_dir).tmax_job
        if not stored:
            raise JobError(f"{job_dir}/config.json was not written by tmax bench (a Harbor job resumes with "
                           "`harbor job resume`; report and compare read it as it is)")
        api_key = overrides.pop("api_key", None)
        cfg = JobSpec.model_validate({**stored, "jobs_dir": str(job_dir.parent), "job_name": job_dir.name})
        env = overrides.get("environment")
        if env is not None and env != cfg.environment:
            raise JobError(f"{job_dir} runs its trials with -e {cfg.environment}, not {env}: the "
                           "environment is part of a job's identity (start a new job to use another)")
        updates = {k: v for k, v in overrides.items() if v is not None}
        return cls(JobSpec.model_validate({**cfg.model_dump(), **updates}), api_key=api_key)

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
                cfg = harbor.TrialConfig(
                    # Harbor's TaskConfig takes a path or a registry name, never both.
                    task=harbor.TaskConfig(path=str(task.path), source=source, checksum=self.checksums[task.name]),
                    trial_name=name, trials_dir=str(self.dir), attempt=attempt,
                    timeout_multiplier=self.config.timeout_multiplier,
                    agent=harbor.AgentConfig(name=self.config.agent, model_name=self.config.model,
                                             kwargs=self.config.agent_kwargs),
                    environment=harbor_environment(self.sandbox_kind, image_map=self.config.image_map),
                    verifier=harbor.VerifierConfig(offline_rewrite=True),
                    job_id=self.job_id,
                )
                out.append(TrialPlan(task, attempt, name, self.dir / name, self.config.job_name, cfg))
        return out

    def _write_config(self) -> None:
        path = self.dir / "config.json"
        existing = read_job_config(self.dir) if path.exists() else None
        if existing is not None:
            if existing.tmax_identity != self.identity:
                raise JobError(
                    f"job {self.dir} already exists with a different configuration (agent, model, tasks, "
                    f"attempts or task contents differ). Use another --job-name, or `tmax bench resume "
                    f"{self.dir}` to continue it as it was.")
            created = JobSpec.model_validate(existing.tmax_job).created_at
        else:
            created = now_iso()
        self.config.created_at = created
        endpoint = {"api_base": self.config.base_url} if self.config.base_url else {}
        cfg = harbor.JobConfig(
            job_name=self.config.job_name, jobs_dir=self.config.jobs_dir, n_attempts=self.config.n_attempts,
            n_concurrent_trials=self.config.n_concurrent, timeout_multiplier=self.config.timeout_multiplier,
            agents=[harbor.AgentConfig(name=self.config.agent, model_name=self.config.model,
                                       kwargs={**self.config.agent_kwargs, **endpoint})],
            datasets=[harbor.DatasetConfig(path=self.config.dataset)],
            environment=harbor_environment(self.sandbox_kind),
            tmax_identity=self.identity, tmax_job=self.config.model_dump())
        write_json_atomic(path, cfg.dump())

    def _trials(self) -> list[tuple[TrialPlan, TrialResult | None]]:
        """Each trial of the plan with its result.json (None: none yet, or not readable)."""
        return [(p, TrialResult.parse(read_json(p.trial_dir / "result.json"))) for p in self.plans()]

    def results(self) -> list[TrialResult]:
        """Finished trials of this job's plan (cancelled ones are not finished)."""
        return [r for _, r in self._trials() if r is not None and r.score().outcome != CANCELLED]

    def write_result(self, progress: Progress | None = None, finished: bool = False) -> harbor.JobResult:
        """Rewrite the job's result.json (Harbor 0.26's JobResult, tmax's scores in `tmax_score`)."""
        trials = self._trials()
        done = [r for _, r in trials if r is not None]
        results = [r for r in done if r.score().outcome != CANCELLED]
        # The interval once the job has finished: not after every trial (see `score`).
        sc = score([TrialRow.of(r) for r in results], interval=finished) if results else None
        running = progress.running if progress else 0
        existing = harbor.JobResult.parse(read_json(self.dir / "result.json"))
        retries = self.dir / ".retries"
        stats = harbor.JobStats(
            n_completed_trials=len(results),
            n_errored_trials=sum(1 for r in results if r.exception_info),
            n_running_trials=running,
            n_pending_trials=max(0, len(trials) - len(results) - running),
            n_cancelled_trials=len(done) - len(results),
            n_retries=len(list(retries.glob("*"))) if retries.is_dir() else 0,
            evals={self._evals_key(): _eval_stats(results, sc)} if sc else {},
            n_input_tokens=sum(r.agent_result.n_input_tokens or 0 for r in results if r.agent_result),
            n_cache_tokens=sum(r.agent_result.n_cache_tokens or 0 for r in results if r.agent_result),
            n_output_tokens=sum(r.agent_result.n_output_tokens or 0 for r in results if r.agent_result),
            cost_usd=None)
        data = harbor.JobResult(
            schema_version=1, id=self.job_id, started_at=(existing.started_at if existing else None) or now_iso(),
            updated_at=now_iso(), finished_at=now_iso() if finished else None, n_total_trials=len(trials),
            stats=stats, trial_results=[], tmax_score=sc.to_dict() if sc else None)
        write_json_atomic(self.dir / "result.json", data.dump())
        return data

    def _evals_key(self) -> str:
        """The key Harbor gives this job's scores: agent, model and the trials' source."""
        name, model = self.agent.name, self.config.model
        source = dataset_source(self.config.dataset) or "adhoc"
        return f"{name}__{model}__{source}" if model else f"{name}__{source}"

    # --- running -------------------------------------------------------------------------
    def _on_sandbox(self, name: str, sb: Sandbox | None) -> None:
        with self._lock:
            if sb is None:
                self._sandboxes.pop(name, None)
            else:
                self._sandboxes[name] = sb
        if sb is not None and self.cancel.is_set():
            _close_quietly(sb)

    def _runner(self, retry_infra: bool) -> tuple[JobRunner, list[JobItem]]:
        """The job's runner and its items, one per trial."""
        runner = JobRunner(_TrialStore(self.dir, retry_infra), slots=self.config.n_concurrent,
                           on_interrupt=self.interrupt)
        return runner, [JobItem(p.trial_name, self._trial, (p,)) for p in self.plans()]

    def pending(self, retry_infra: bool = False) -> tuple[list[TrialPlan], int]:
        """Trials still to run, and how many are already done."""
        runner, items = self._runner(retry_infra)
        todo, prior = runner.pending(items)
        return [item.args[0] for item in todo], len(prior)

    def run(self, progress_fn: ProgressFn | None = None, retry_infra: bool = False) -> harbor.JobResult:
        """Every trial without a result (`tasks.job_runner`: finished trials are read back,
        partial ones rerun), `n_concurrent` at a time; the job's result.json after each."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        runner, items = self._runner(retry_infra)
        todo, prior = runner.pending(items)
        prog = Progress(total=len(todo) + len(prior), done=len(prior), skipped=len(prior))
        for r in prior.values():
            _count(prog, r)
        self.write_result(prog)
        if todo:
            sandbox_class(self.sandbox_kind).prestart()  # podman's service starts while the first trial looks up its image
        live = self._live = self._start_live([item.args[0] for item in todo])
        emit = progress_fn or (lambda *a: None)
        emit("start", prog, None)

        def started(item: JobItem) -> None:
            prog.running += 1
            emit("trial_start", prog, {"trial_name": item.name, "task": item.args[0].task.name})

        def finished(f: Finished) -> None:
            prog.running -= 1
            prog.trial_seconds.append(f.seconds)
            if f.result is None or f.result.score().outcome == CANCELLED:
                return
            prog.done += 1
            _count(prog, f.result)
            self.write_result(prog)
            emit("trial_end", prog, f.result)

        try:
            runner.execute(todo, on_start=started, on_finished=finished)
        except KeyboardInterrupt:
            self.write_result(prog)
            wait_for_closes()
            emit("cancelled", prog, None)
            raise
        data = self.write_result(prog, finished=True)
        wait_for_closes()  # every container of the job is gone when it ends
        if live.env.pool is not None:
            live.env.pool.close()
        emit("end", prog, None)
        return data

    def _start_live(self, line: list[TrialPlan]) -> _Live:
        """What the trials of one run share: their environment, the pool (podman: trials as
        overlays of shared containers with `overlay`, else containers started ahead with
        `warm_ahead`) and what starts containers in it for the trials next in line."""
        pool = make_pool(self.sandbox_kind, self.config.n_concurrent, self.config.warm_ahead,
                         overlay=self.config.overlay, host_labels={JOB_LABEL: self.config.job_name})
        # Trials as overlays of shared containers: a task that is its base image plus files is not built.
        settings = EnvSettings(self.sandbox_kind, self.rewrite, self.config.use_prebuilt, self.config.override_cpus,
                               self.config.override_memory_mb,
                               files_layer=pool is not None and pool.capabilities().overlay)
        env = TrialEnv(agent=self.agent, env=settings, timeout_multiplier=self.config.timeout_multiplier,
                       cancel=self.cancel, on_sandbox=self._on_sandbox, model_name=self.config.model,
                       close_in_background=True, pool=pool)
        ahead = WarmAhead(self.config.warm_ahead if pool is not None else 0,
                          start=lambda plan: prewarm_trial(plan, env), key=lambda plan: plan.trial_name)
        return _Live(env, ahead, line, {p.trial_name: i for i, p in enumerate(line)})

    def _trial(self, plan: TrialPlan) -> TrialResult | None:
        """One trial of the running job (on a runner thread); None when the job was
        interrupted before it began."""
        live = self._live
        assert live is not None
        if self.cancel.is_set():
            return None
        live.ahead.fill_after(live.line, live.index[plan.trial_name], self.config.n_concurrent)
        return run_trial(plan, live.env)

    @property
    def _pool(self) -> SandboxPool | None:
        """The warm pool of the running (or last) run, if it had one."""
        return self._live.env.pool if self._live is not None else None

    def interrupt(self) -> None:
        """Stop: no new trials; running ones are cancelled and their containers removed."""
        self.cancel.set()
        with self._lock:
            sandboxes = list(self._sandboxes.values())
        for sb in sandboxes:
            _close_quietly(sb)
        if self._pool is not None:
            self._pool.close(in_use=True)


@dataclass
class _Live:
    """A running job's shared state: the trials' environment and the warm-ahead over the
    trials to run, in their order (`index`: a trial's place in it)."""

    env: TrialEnv
    ahead: WarmAhead
    line: list[TrialPlan]
    index: dict[str, int]


class _TrialStore:
    """The bench job's results for the runner: a trial finished when its result.json says
    so. A cancelled trial did not (nor, with `retry_infra`, one that ended in an
    infrastructure error: its directory moves to `.retries/`, never silently deleted); a
    partial directory is removed. `run_trial` writes result.json itself, atomically."""

    def __init__(self, job_dir: Path, retry_infra: bool):
        self.dir, self.retry_infra = job_dir, retry_infra

    def prior(self, item: JobItem) -> TrialResult | None:
        trial_dir = self.dir / item.name
        r = TrialResult.parse(read_json(trial_dir / "result.json"))
        outcome = r.score().outcome if r is not None else None
        if r is not None and outcome != CANCELLED and not (self.retry_infra and outcome == INFRA_ERROR):
            return r
        if trial_dir.exists():
            if outcome == INFRA_ERROR:
                dst = self.dir / ".retries" / f"{item.name}.{int(time.time() * 1000)}"
                dst.parent.mkdir(parents=True, exist_ok=True)
                trial_dir.rename(dst)
            else:  # cancelled or never finished: a partial directory, start afresh
                shutil.rmtree(trial_dir, ignore_errors=True)
        return None

    def save(self, item: JobItem, result: Any) -> None:
        pass  # result.json is the trial's own last write


def _eval_stats(results: list[TrialResult], sc: Score) -> harbor.AgentDatasetStats:
    """Harbor's AgentDatasetStats for one agent on one dataset: the mean (errors count 0)
    and pass@k, the trials by reward and by exception."""
    reward_stats: dict[str, list[str]] = {}
    exc_stats: dict[str, list[str]] = {}
    for r in results:
        if r.reward is not None:
            reward_stats.setdefault(str(r.reward), []).append(r.trial_name)
        if r.exception_type:
            exc_stats.setdefault(r.exception_type, []).append(r.trial_name)
    return harbor.AgentDatasetStats(
        n_trials=sum(len(v) for v in reward_stats.values()),
        n_errors=sum(len(v) for v in exc_stats.values()),
        metrics=[{"mean": sc.mean_reward}],
        pass_at_k={str(k): v for k, v in sc.pass_at_k.items()},
        reward_stats={"reward": reward_stats},
        exception_stats=exc_stats,
    )



def _close_quietly(sb: Sandbox) -> None:
    try:
        sb.close()
    except Exception:
        pass


def _count(prog: Progress, r: TrialResult) -> None:
    verdict = r.score()
    prog.outcomes[verdict.outcome] = prog.outcomes.get(verdict.outcome, 0) + 1
    prog.reward_sum += verdict.credit
    prog.passed += verdict.passed
