"""The validation gates of a task, each recorded per task.

    load     task.toml parses, the required files are there (`tasks.task_format.Task.load`)
    build    the image builds with bench's offline rewrites (podman) and its `[agent] user`
             can open a shell there, or the Dockerfile fits a host sandbox (bwrap, local:
             `tasks.hostenv`, which run as the invoking user)
    initial  tests/test_initial_state.py passes on the untouched environment (if present)
    nop      the verifier on the untouched environment gives reward 0
    oracle   solution/solve.sh, then the verifier, gives reward 1

`oracle` runs solve.sh as the agent's user, as Harbor's oracle agent does; the tests run
as the verifier's user. `initial` and `nop` share one trial (the initial-state check is
that trial's "agent" and changes nothing); `oracle` is a second trial, run at the same
time. Trials run with bench's machinery (`tasks.trial.run_trial`) and keep their Harbor
trial directories under the work dir. A task without `solution/` is `unverified` (failed:
["oracle"]) unless another gate failed. A build that fails for the infrastructure (a mirror
that did not answer after the retries, podman itself) is an infrastructure error, not the
task's rejection. A corpus is validated as a job (`tasks.job_runner`): per
task a result as it finishes, so a rerun resumes.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, Field

from tmax.common.files import write_json_atomic
from tmax.common.records import InitialCheck
from tmax.tasks.harbor import FAIL, PASS, AgentConfig, TaskConfig, TrialConfig, TrialResult
from tmax.sandbox import make_sandbox
from tmax.sandbox.base import IMAGE_USER, AgentUserError, SandboxError
from tmax.tasks.corpus.package import LITE_RUNNER, run_tests_command
from tmax.tasks.job_runner import Backend, Finished, JobItem, JobRunner, ResultFiles
from tmax.tasks.episode import EnvSettings, sandbox_spec
from tmax.tasks.hostenv import HOST_KINDS, HostEnvError, check_dockerfile
from tmax.tasks.task_images import ImageBuildError, TaskImage, ensure_image
from tmax.tasks.task_format import Task, TaskError, tree_hash
from tmax.tasks.offline import RewriteConfig, default_config
from tmax.tasks.runners import AgentRun, OracleAgent
from tmax.tasks.trial import TrialEnv, TrialPlan, run_trial

GATES = ("load", "build", "initial", "nop", "oracle")
INITIAL_TEST = "test_initial_state.py"
NO_SOLUTION = "no solution/solve.sh (nothing shows the task can be solved)"
REASON_CHARS = 1500


class GateReport(BaseModel):
    task: str
    verdict: Literal["ok", "rejected", "unverified", "infra_error"]  # infra_error: not judged, run it again
    failed: list[str] = Field(default_factory=list)
    reasons: dict[str, str] = Field(default_factory=dict)
    gates: dict[str, str] = Field(default_factory=dict)  # gate -> ok | failed | skipped
    # Gates that failed because the infrastructure did (sandbox, podman), not the task:
    # such a task is not judged; `generate` retries it without spending a round.
    infra_errors: list[str] = Field(default_factory=list)


class InitialCheckAgent:
    """The `initial` gate as a trial agent: runs the initial-state test in the fresh
    environment from a private directory and touches nothing else. It is a test, so it
    runs as the verifier does (the image's USER unless `[verifier] user` says otherwise)."""

    name = "initial-check"
    version = "1"
    uses_shell = False

    def run(self, sandbox, task, workdir, agent_dir, timeout, cancel) -> AgentRun:
        test = task.tests_dir / INITIAL_TEST
        if not test.is_file():
            return AgentRun(metadata=InitialCheck(initial="absent").model_dump())
        remote = f"/tmp/tmax-initial-{uuid.uuid4().hex[:12]}"
        with tempfile.TemporaryDirectory(prefix="tmax-initial-") as tmp:
            shutil.copyfile(test, Path(tmp) / INITIAL_TEST)
            shutil.copyfile(LITE_RUNNER, Path(tmp) / "pytest_lite.py")
            sandbox.copy_in(Path(tmp), remote)
        user = task.config.verifier.user or IMAGE_USER
        try:
            res = sandbox.exec(["bash", "-c", run_tests_command(f"{remote}/{INITIAL_TEST}") + " 2>&1"],
                               timeout=timeout, workdir=workdir, user=user)
        finally:
            try:
                sandbox.exec(["rm", "-rf", remote], timeout=60, user=IMAGE_USER)
            except SandboxError:
                pass
        status = "passed" if res.exit_code == 0 and not res.timed_out else "failed"
        return AgentRun(metadata=InitialCheck(initial=status, output=res.output[-REASON_CHARS:]).model_dump())


def _verdict(name: str, gates: dict[str, str], reasons: dict[str, str], no_solution: bool) -> GateReport:
    failed = [g for g in GATES if gates.get(g) == "failed"]
    if not failed:
        verdict = "ok"
    elif failed == ["oracle"] and no_solution:
        verdict = "unverified"
    else:
        verdict = "rejected"
    return GateReport(task=name, verdict=verdict, failed=failed, reasons=reasons, gates=gates)


def _build(task: Task, env_kind: str, rewrite: RewriteConfig) -> tuple[str | None, bool]:
    """(None when the environment can be made, else why not; whether that is the
    infrastructure's doing rather than the task's)."""
    try:
        if env_kind in HOST_KINDS:
            check_dockerfile(task)
            return None, False
        image = ensure_image(task, rewrite)
    except ImageBuildError as e:
        return str(e), e.kind != "task"
    except (HostEnvError, OSError, ValueError) as e:
        return str(e), False
    return _agent_user_problem(task, image, rewrite), False


def _agent_user_problem(task: Task, image: TaskImage, rewrite: RewriteConfig) -> str | None:
    """The image must let `[agent] user` open a shell in its WORKDIR (the user exists and
    may enter it): a task's own defect, told apart here from the trials' infrastructure."""
    user = task.config.agent.user
    if not user:
        return None
    sandbox = make_sandbox("podman", sandbox_spec(task, EnvSettings(rewrite=rewrite), image, None))
    try:
        sandbox.start()
    except AgentUserError as e:
        return f"[agent] user = {user!r} in task.toml: {e}"
    except SandboxError:
        return None  # infrastructure: the trials meet it again and label it so
    finally:
        sandbox.close()
    return None


def _trial(task: Task, agent, env_kind: str, rewrite: RewriteConfig, trial_dir: Path) -> TrialResult:
    shutil.rmtree(trial_dir, ignore_errors=True)
    name = f"{task.name}__{trial_dir.name}"
    # Harbor's TaskConfig takes a path or a registry name, never both.
    config = TrialConfig(task=TaskConfig(path=str(task.path)), trial_name=name, agent=AgentConfig(name=agent.name))
    plan = TrialPlan(task, 0, name, trial_dir, "tmax-data-validate", config)
    return run_trial(plan, TrialEnv(agent=agent, env=EnvSettings(env_kind, rewrite)))


def _trial_problem(result: TrialResult, trial_dir: Path) -> str:
    """Why a trial did not score as hoped: its exception, or the tail of the verifier log."""
    exc = result.exception_info
    if exc:
        return f"{exc.exception_type}: {exc.exception_message}"[-REASON_CHARS:]
    log = trial_dir / "verifier" / "test-stdout.txt"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return f"reward {result.reward}; verifier output: {text[-REASON_CHARS:]}"


def _run_gates(task: Task, work: Path, env_kind: str, rewrite: RewriteConfig,
               gates: dict[str, str], reasons: dict[str, str], infra: list[str]) -> None:
    # The two trials are independent environments: run them at once.
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tmax-gates") as pool:
        nop_run = pool.submit(_trial, task, InitialCheckAgent(), env_kind, rewrite, work / "nop")
        oracle_run = pool.submit(_trial, task, OracleAgent(rewrite), env_kind, rewrite, work / "oracle") \
            if task.has_solution else None
        nop = nop_run.result()
        oracle = oracle_run.result() if oracle_run else None
    if nop.score().infra:
        infra += ["initial", "nop"]
    check = InitialCheck.of(nop.agent_result.metadata if nop.agent_result else None)
    if check is not None and check.initial == "absent":
        gates["initial"] = "skipped"
    elif check is not None and check.initial == "passed":
        gates["initial"] = "ok"
    else:
        gates["initial"] = "failed"
        reasons["initial"] = (check.output if check is not None else "") or _trial_problem(nop, work / "nop")
    verdict = nop.score()
    if verdict.outcome == FAIL:
        gates["nop"] = "ok"
    else:
        gates["nop"] = "failed"
        reasons["nop"] = ("the verifier gives reward 1 on the untouched environment (the final test "
                          "passes before any work)") if verdict.passed else _trial_problem(nop, work / "nop")
    if oracle is None:
        gates["oracle"], reasons["oracle"] = "failed", NO_SOLUTION
        return
    if oracle.score().infra:
        infra.append("oracle")
    if oracle.score().outcome == PASS:  # reward 1 within the agent's time (a timed-out pass is no proof)
        gates["oracle"] = "ok"
    else:
        gates["oracle"] = "failed"
        out = work / "oracle" / "agent" / "oracle.txt"
        tail = out.read_text(errors="replace")[-600:] if out.is_file() else ""
        reasons["oracle"] = f"solution/solve.sh did not reach reward 1: {_trial_problem(oracle, work / 'oracle')}" \
                            + (f"; solve.sh output: {tail}" if tail else "")


def validate_task(path: Path, work: Path, env_kind: str = "podman",
                  rewrite: RewriteConfig | None = None) -> GateReport:
    """Run every gate on one task directory; trial directories and gates.json go under `work`."""
    report = _gates(path, work, env_kind, rewrite or default_config())
    write_json_atomic(work / "gates.json", report.model_dump())
    return report


def _gates(path: Path, work: Path, env_kind: str, rewrite: RewriteConfig) -> GateReport:
    gates: dict[str, str] = {}
    reasons: dict[str, str] = {}
    try:
        task = Task.load(path)
    except TaskError as e:
        gates["load"], reasons["load"] = "failed", str(e)
        return _verdict(path.name, gates, reasons, False)
    gates["load"] = "ok"
    why, infra_fault = _build(task, env_kind, rewrite)
    if why:
        gates["build"], reasons["build"] = "failed", ("infrastructure error: " if infra_fault else "") + why
        return _with_infra(_verdict(task.name, gates, reasons, not task.has_solution), ["build"] if infra_fault else [])
    gates["build"] = "ok"
    infra: list[str] = []
    _run_gates(task, work, env_kind, rewrite, gates, reasons, infra)
    for gate in infra:
        reasons[gate] = "infrastructure error: " + reasons.get(gate, "")
    return _with_infra(_verdict(task.name, gates, reasons, not task.has_solution), infra)


def _with_infra(report: GateReport, infra: list[str]) -> GateReport:
    """A gate the infrastructure failed leaves the task unjudged, unless a gate of its own
    failed too (then it is rejected for that)."""
    report.infra_errors = infra
    if infra and not set(report.failed) - set(infra):
        report.verdict = "infra_error"
    return report


WORK_DIR = ".tmax-validate"
RESULTS_DIR = "results"  # one <task>.json per finished task: what a rerun resumes from


def default_work_dir(root: Path) -> Path:
    """Where validation keeps its trials: beside the tasks, never inside one (a single task
    directory is validated from its parent's work dir)."""
    root = Path(root)
    return (root.parent if (root / "task.toml").is_file() else root) / WORK_DIR


def corpus_task_dirs(root: Path) -> list[Path]:
    """Every direct sub-directory of a corpus that is (or tries to be) a task: it has a
    task.toml or an instruction.md. A missing task.toml then fails the `load` gate."""
    root = Path(root)
    if (root / "task.toml").is_file():
        return [root]
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))
                  and ((d / "task.toml").exists() or (d / "instruction.md").exists()))


def validate_job(path: str, work: str, env_kind: str) -> dict:
    """One task's gates as a job item (plain arguments, so it runs on any node)."""
    return validate_task(Path(path), Path(work), env_kind, default_config()).model_dump()


def task_identity(task_dir: Path, env_kind: str) -> str:
    """What a validation result stands for: the task's content and where it ran."""
    try:
        return f"{env_kind}:{tree_hash(task_dir)}"
    except OSError:
        return f"{env_kind}:unreadable"


def validate_corpus(root: Path, work: Path, env_kind: str = "podman", n_concurrent: int = 2,
                    on_done: Callable[[GateReport, bool], None] | None = None,
                    backend: Backend | None = None) -> list[GateReport]:
    """Validate every task of a corpus as job items; reports come back in name order.
    A task validated before (same content, same environment kind, no infrastructure error)
    is not run again: its result is read from `<work>/results/`."""
    work = Path(work).resolve()
    items = [JobItem(d.name, validate_job, (str(d.resolve()), str(work / d.name), env_kind), task_identity(d, env_kind))
             for d in corpus_task_dirs(root)]

    def finished(f: Finished) -> None:
        if on_done:
            on_done(GateReport.model_validate(f.result), f.resumed)

    store = ResultFiles(work / RESULTS_DIR, done=lambda r: not GateReport.model_validate(r).infra_errors)
    results = JobRunner(store, backend, slots=n_concurrent).run(items, on_finished=finished)
    return sorted((GateReport.model_validate(r) for r in results.values()), key=lambda r: r.task)


def counts(reports: list[GateReport]) -> dict:
    out = {"tasks": len(reports), "ok": 0, "rejected": 0, "unverified": 0, "infra_error": 0}
    per_gate = {g: 0 for g in GATES}
    for r in reports:
        out[r.verdict] += 1
        for g in r.failed:
            per_gate[g] += 1
    out["failed_by_gate"] = per_gate
    out["infra_errors"] = sum(1 for r in reports if r.infra_errors)
    return out
