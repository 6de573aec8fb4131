"""`tmax data solve`: difficulty of every task as pass@k of a bench agent.

The attempts run as a bench job (`tasks.job.Job`, k attempts per task) under
`<corpus>/.tmax-solve/jobs/`, so a rerun resumes. Per task a summary is written to
`<corpus>/.tmax-solve/<tag>/<task>.json`: attempts (k), scored runs (n), successes (c),
the success rate c/n and the unbiased pass@k for every k up to n. Infrastructure errors
are left out (they are not the agent's failures): n counts only the attempts that
reached a verdict. `--band` filters on c/n: pass@k at k = n is 1 as soon as one attempt
succeeds, so it cannot tell a task solved 1 of 8 times from one solved 8 of 8 times.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable

from agents.records import write_json_atomic
from tasks.corpus.report import SOLVE_DIR, success_rate
from tasks.job import Job, JobConfig, trial_row
from tasks.scoring import SUCCESS, pass_at_k


def solver_tag(agent: str, model: str | None) -> str:
    return agent if not model else f"{agent}_{model.replace('/', '_')}"


def task_summary(task: str, rows: list[dict], agent: str, model: str | None) -> dict:
    scored = [r for r in rows if r["outcome"] != "infra_error"]
    n = len(scored)
    c = sum(1 for r in scored if r["reward"] is not None and float(r["reward"]) >= SUCCESS)
    return {
        "task": task, "agent": agent, "model": model,
        "num_attempts": len(rows), "num_runs": n, "num_success": c, "num_infra_errors": len(rows) - n,
        "success_rate": c / n if n else None,
        "pass_at_k": {str(k): pass_at_k(n, c, k) for k in range(1, n + 1)},
        "results": [{"trial": r["trial"], "outcome": r["outcome"], "reward": r["reward"]} for r in rows],
    }


def solve_corpus(corpus: Path, agent: str, k: int, *, model: str | None = None, base_url: str | None = None,
                 api_key: str | None = None, environment: str = "podman", n_concurrent: int = 2,
                 agent_kwargs: dict | None = None, progress_fn: Callable | None = None) -> dict[str, dict]:
    """Run k attempts per task and write the summaries; returns {task: summary}."""
    corpus = Path(corpus).expanduser().resolve()
    tag = solver_tag(agent, model)
    cfg = JobConfig(job_name=tag, jobs_dir=str(corpus / SOLVE_DIR / "jobs"), dataset=str(corpus), agent=agent,
                    model=model, base_url=base_url, agent_kwargs=agent_kwargs or {}, n_attempts=k,
                    n_concurrent=n_concurrent, environment=environment)
    job = Job(cfg, api_key=api_key)
    job.run(progress_fn)
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in job.results():
        by_task[r["task_name"]].append(trial_row(r))
    out = {}
    for task in sorted(by_task):
        out[task] = task_summary(task, by_task[task], agent, model)
        write_json_atomic(corpus / SOLVE_DIR / tag / f"{task}.json", out[task])
    return out


def parse_band(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        band = (float(lo), float(hi))
    except ValueError:
        band = None
    if not sep or band is None or not 0 <= band[0] <= band[1] <= 1:
        raise ValueError(f"--band {text!r}: expected LO:HI with 0 <= LO <= HI <= 1, e.g. 0.1:0.9")
    return band


def in_band(summaries: dict[str, dict], band: tuple[float, float]) -> list[str]:
    """Tasks whose success rate c/n lies in [LO, HI] (tasks without a scored run are left out)."""
    lo, hi = band
    rates = {t: success_rate(s) for t, s in summaries.items()}
    return sorted(t for t, r in rates.items() if r is not None and lo <= r <= hi)
