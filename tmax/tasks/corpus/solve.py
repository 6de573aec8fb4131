"""`tmax data solve`: difficulty of every task as pass@k of a bench agent.

Each task is an item of a `tasks.job_runner` job (local threads, or Ray): a bench job
(`tasks.job.Job`, k attempts) of that task under `<corpus>/.tmax-solve/jobs/<tag>/`, so a
rerun resumes, and a task solved before (same content, same settings) is read back. Per task a summary is written to
`<corpus>/.tmax-solve/<tag>/<task>.json`: attempts (k), scored runs (n), successes (c),
the success rate c/n and the unbiased pass@k for every k up to n. Infrastructure errors
are left out (they are not the agent's failures): n counts only the attempts that
reached a verdict. `--band` filters on c/n: pass@k at k = n is 1 as soon as one attempt
succeeds, so it cannot tell a task solved 1 of 8 times from one solved 8 of 8 times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tmax.common.records import SolveAttempt, SolveSummary, write_record
from tmax.tasks.corpus.balance_report import SOLVE_DIR
from tmax.tasks.dataset import task_dirs
from tmax.tasks.job import Job, JobSpec
from tmax.tasks.job_runner import Backend, JobItem, JobRunner, ResultFiles
from tmax.tasks.task_format import Task, TaskError
from tmax.tasks.scoring import TrialRow, pass_at_k


def solver_tag(agent: str, model: str | None) -> str:
    return agent if not model else f"{agent}_{model.replace('/', '_')}"


def task_summary(task: str, rows: list[TrialRow], agent: str, model: str | None) -> SolveSummary:
    scored = [r for r in rows if not r.verdict.infra]
    n = len(scored)
    c = sum(r.verdict.passed for r in scored)
    return SolveSummary(
        task=task, agent=agent, model=model, num_attempts=len(rows), num_runs=n, num_success=c,
        num_infra_errors=len(rows) - n, pass_at_k={str(k): pass_at_k(n, c, k) for k in range(1, n + 1)},
        results=[SolveAttempt(trial=r.trial, outcome=r.verdict.outcome, reward=r.verdict.reward) for r in rows])


def solve_task(corpus: str, task: str, spec: str, api_key: str | None) -> dict:
    """k attempts of one task as a job item (plain arguments, so it runs on any node):
    a bench job of that task alone under `<corpus>/.tmax-solve/jobs/<tag>/`, which resumes
    its own trials; the summary is written where `report` reads it and returned (as JSON,
    what the job keeps of an item)."""
    cfg = JobSpec.model_validate_json(spec).model_copy(update={"include": [task], "job_name": task})
    job = Job(cfg, api_key=api_key)
    job.run(retry_infra=True)
    rows = [TrialRow.of(r) for r in job.results() if r.task_name == task]
    summary = task_summary(task, rows, cfg.agent, cfg.model)
    tag = solver_tag(cfg.agent, cfg.model)
    write_record(Path(corpus) / SOLVE_DIR / tag / f"{task}.json", summary)
    return summary.model_dump(mode="json")


def solve_corpus(corpus: Path, agent: str, k: int, *, model: str | None = None, base_url: str | None = None,
                 api_key: str | None = None, environment: str = "podman", n_concurrent: int = 2,
                 agent_kwargs: dict | None = None, backend: Backend | None = None,
                 on_task: Callable[[SolveSummary, bool], None] | None = None
                 ) -> tuple[dict[str, SolveSummary], dict[str, str]]:
    """k attempts per task, each task a job item (local threads, or the backend given);
    a task solved before with the same content and settings is read back. ({task: summary},
    {task that does not load: why}): the others are solved all the same."""
    corpus = Path(corpus).expanduser().resolve()
    tag = solver_tag(agent, model)
    cfg = JobSpec(job_name=tag, jobs_dir=str(corpus / SOLVE_DIR / "jobs" / tag), dataset=str(corpus), agent=agent,
                    model=model, base_url=base_url, agent_kwargs=agent_kwargs or {}, n_attempts=k,
                    n_concurrent=1, environment=environment)
    spec = cfg.model_dump_json()
    items, unreadable = [], {}
    for d in task_dirs(corpus):
        try:
            t = Task.load(d)
        except TaskError as e:
            unreadable[d.name] = str(e)
            continue
        items.append(JobItem(t.name, solve_task, (str(corpus), t.name, spec, api_key), f"{spec}:{t.checksum()}"))
    store = ResultFiles(corpus / SOLVE_DIR / "jobs" / tag / ".results",
                        done=lambda r: not SolveSummary.model_validate(r).num_infra_errors)
    results = JobRunner(store, backend, slots=n_concurrent).run(
        items, on_finished=lambda f: on_task and on_task(SolveSummary.model_validate(f.result), f.resumed))
    return {t: SolveSummary.model_validate(r) for t, r in sorted(results.items())}, unreadable


def parse_band(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        band = (float(lo), float(hi))
    except ValueError:
        band = None
    if not sep or band is None or not 0 <= band[0] <= band[1] <= 1:
        raise ValueError(f"--band {text!r}: expected LO:HI with 0 <= LO <= HI <= 1, e.g. 0.1:0.9")
    return band


def in_band(summaries: dict[str, SolveSummary], band: tuple[float, float]) -> list[str]:
    """Tasks whose success rate c/n lies in [LO, HI] (tasks without a scored run are left out)."""
    lo, hi = band
    rates = {t: s.success_rate for t, s in summaries.items()}
    return sorted(t for t, r in rates.items() if r is not None and lo <= r <= hi)
