"""Compare jobs over the same tasks (any agents, harnesses, models): `tmax bench compare`.

Per job: pass@1 and pass@k (k = the smallest number of scored attempts any task has), each
the mean over tasks of the unbiased per-task estimate, with a 95 % interval whose method
is named (`tasks.scoring.rate_interval`: exact for few tasks, a nested bootstrap for
many); mean steps, tokens and wall time per trial. A trial passed when its verifier's
reward is 1, whether or not its agent timed out (`tasks.harbor.TrialResult.score`, the
rule `bench report` uses too). Infrastructure errors are not the agent's: they are left
out of every rate and counted apart.

Per pair of jobs (A, B), on the tasks both scored, each task becomes one paired 0/1
outcome per job: *solved* when more than half of its scored attempts passed (one attempt:
it passed; k attempts: a majority, a tie counting as not solved). The discordant tasks
(solved by A not B, and the reverse) get McNemar's exact test: the two-sided binomial p
of the smaller count under p = 1/2.

Job directories come from tmax, Harbor or other agents (`tasks.job_dirs.load_job_results`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import comb
from pathlib import Path

from tmax.tasks.harbor import JobConfig, TrialResult
from tmax.tasks.job_dirs import load_job_results
from tmax.tasks.scoring import TrialRow, pass_at_k, rate_interval, score

SOLVED_RULE = "a task is solved when more than half of its scored attempts passed"


@dataclass
class JobSummary:
    name: str
    path: str
    agent: str
    model: str | None
    n_trials: int
    n_infra_errors: int
    k: int
    pass_at_1: float
    pass_at_1_ci: tuple[float, float]
    pass_at_k: float
    pass_at_k_ci: tuple[float, float]
    ci_method: str
    mean_steps: float | None
    mean_tokens: float | None
    mean_wall_s: float | None
    # task -> (scored attempts, passes)
    per_task: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class PairSummary:
    a: str
    b: str
    n_common_tasks: int
    a_not_b: list[str]
    b_not_a: list[str]
    both: int
    neither: int
    p_value: float


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for discordant counts b and c."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _agent(cfg: JobConfig, results: list[TrialResult]) -> tuple[str, str | None]:
    """(agent, model) of a job: what its trials name (their config, else the name an
    import-path agent gave), else the job's config."""
    agent = next((r.agent_name for r in results if r.agent_name), None)
    model = next((r.model_name for r in results if r.model_name), None)
    first = cfg.agent
    if first is not None:
        agent = agent or first.name or first.import_path
        model = model or first.model_name
    return agent or "?", model


def summarize_job(job_dir: Path) -> JobSummary:
    cfg, results = load_job_results(job_dir)
    # The report's rule and numbers: pass@k per task over its scored attempts (`scoring.score`).
    per_task = {t.task: (t.n_scored, t.successes) for t in score([TrialRow.of(r) for r in results], interval=False).tasks
                if t.n_scored}
    scored = [r for r in results if not r.score().infra]
    k = min((n for n, _ in per_task.values()), default=1)
    at1 = [pass_at_k(n, c, 1) for n, c in per_task.values()]
    atk = [pass_at_k(n, c, k) for n, c in per_task.values()]
    ci1, method = rate_interval(list(per_task.values()), 1)
    cik, _ = rate_interval(list(per_task.values()), k)
    agent, model = _agent(cfg, results)
    steps = [float(s) for r in scored if (s := r.agent_steps) is not None]
    walls = [s for r in scored if (s := r.wall_s) is not None]
    return JobSummary(
        name=job_dir.name, path=str(job_dir), agent=agent, model=model,
        n_trials=len(results), n_infra_errors=len(results) - len(scored), k=k,
        pass_at_1=_mean(at1) or 0.0, pass_at_1_ci=ci1, pass_at_k=_mean(atk) or 0.0, pass_at_k_ci=cik,
        ci_method=method, mean_steps=_mean(steps), mean_tokens=_mean([float(r.n_tokens) for r in scored]),
        mean_wall_s=_mean(walls), per_task=per_task)


def _solved(nc: tuple[int, int]) -> bool:
    n, c = nc
    return n > 0 and 2 * c > n


def compare_pair(a: JobSummary, b: JobSummary) -> PairSummary:
    common = sorted(set(a.per_task) & set(b.per_task))
    a_not_b = [t for t in common if _solved(a.per_task[t]) and not _solved(b.per_task[t])]
    b_not_a = [t for t in common if _solved(b.per_task[t]) and not _solved(a.per_task[t])]
    both = sum(1 for t in common if _solved(a.per_task[t]) and _solved(b.per_task[t]))
    return PairSummary(a.name, b.name, len(common), a_not_b, b_not_a, both,
                       len(common) - both - len(a_not_b) - len(b_not_a), mcnemar_exact(len(a_not_b), len(b_not_a)))


@dataclass
class Comparison:
    jobs: list[JobSummary]
    pairs: list[PairSummary]

    def to_dict(self) -> dict:
        return {"jobs": [asdict(j) for j in self.jobs], "pairs": [asdict(p) for p in self.pairs],
                "paired_outcome": SOLVED_RULE}


def compare_jobs(job_dirs: list[Path]) -> Comparison:
    jobs = [summarize_job(Path(d)) for d in job_dirs]
    if len({j.name for j in jobs}) < len(jobs):  # e.g. <model>/terminal-bench-2-0: name them by their parent too
        for j, d in zip(jobs, job_dirs):
            j.name = f"{Path(d).resolve().parent.name}/{j.name}"
    pairs = [compare_pair(jobs[i], jobs[j]) for i in range(len(jobs)) for j in range(i + 1, len(jobs))]
    return Comparison(jobs, pairs)


def write_compare_chart(comp: Comparison, path: Path) -> Path:
    """One PNG: pass@1 and pass@k per job with their 95 % intervals."""
    from tmax.tasks.charts import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * len(comp.jobs), 3.6))
    xs = range(len(comp.jobs))
    for offset, key, label in ((-0.18, "pass_at_1", "pass@1"), (0.18, "pass_at_k", "pass@k")):
        vals = [getattr(j, key) * 100 for j in comp.jobs]
        lo = [v - getattr(j, key + "_ci")[0] * 100 for v, j in zip(vals, comp.jobs)]
        hi = [getattr(j, key + "_ci")[1] * 100 - v for v, j in zip(vals, comp.jobs)]
        ax.bar([x + offset for x in xs], vals, width=0.34, yerr=[lo, hi], capsize=3, label=label)
    ax.set_xticks(list(xs), [j.name for j in comp.jobs], rotation=15, fontsize=8)
    ax.set_ylim(0, 105)
    methods = sorted({j.ci_method for j in comp.jobs})
    ax.set_ylabel(f"% of tasks (95 % CI: {'; '.join(methods)})", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
