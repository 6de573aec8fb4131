"""Reading any job directory, for reports and comparisons: tmax's own, Harbor's (0.26, and
the 0.6.6 of the published Terminal-Bench jobs), or another agent's, as typed records
(`tasks.harbor`). What a trial scored is `TrialResult.score`, the same rule for all of
them; a trial another tool wrote gets the tmax fields a report shows filled in from its
directory (`_found`): the category from the task, the agent's steps from its trajectory."""

from __future__ import annotations

from pathlib import Path

from tmax.common.records import SessionDir
from tmax.common.files import read_json
from tmax.tasks.harbor import CANCELLED, JobConfig, TaskConfig, TmaxTrial, TrialResult
from tmax.tasks.job import read_job_config
from tmax.tasks.task_format import load_config


def load_job_results(job_dir: Path) -> tuple[JobConfig, list[TrialResult]]:
    """(config.json, finished trial results) of any job directory, for reports. A trial
    without a readable result.json has not finished and is left out, and so is a cancelled
    one; one without tmax's fields gets those a report shows (`_found`)."""
    cfg = read_job_config(job_dir)
    results = []
    categories: dict[str, str | None] = {}
    for d in sorted(job_dir.iterdir()):
        if d.is_dir() and not d.name.startswith("."):
            r = TrialResult.parse(read_json(d / "result.json"))
            if r is None or r.score().outcome == CANCELLED:
                continue
            if r.tmax is None:
                r.tmax = _found(r, d, categories)
            results.append(r)
    return cfg, results


def _found(r: TrialResult, trial_dir: Path, categories: dict[str, str | None]) -> TmaxTrial:
    """tmax's fields for a trial another tool wrote: the category from the task's task.toml
    when it is reachable, else from the trial config; the agent's steps from its trajectory.
    The outcome is left to `TrialResult.score`."""
    task = r.config.task if r.config else None
    key = str((task.path if task else None) or r.task_name)
    if key not in categories:
        categories[key] = _task_category(task)
    return TmaxTrial(category=categories[key], agent_steps=trajectory_steps(SessionDir(trial_dir / "agent").trajectory))


def _task_category(task: TaskConfig | None) -> str | None:
    if task is None:
        return None
    if task.path:
        try:
            category = load_config(Path(task.path).expanduser() / "task.toml").metadata.get("category")
            if category:
                return str(category)
        except Exception:  # the task is elsewhere or unreadable: fall back to the config
            pass
    return task.category or (task.metadata or {}).get("category")


def trajectory_steps(path: Path) -> int | None:
    """The agent's steps in a trajectory file: ATIF's steps whose source is the agent, or the
    assistant messages of chat messages (a list, or an object holding `messages`)."""
    doc = read_json(path) if path.is_file() else None
    if isinstance(doc, dict) and isinstance(doc.get("steps"), list):
        return sum(1 for s in doc["steps"] if isinstance(s, dict) and s.get("source") == "agent")
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
        doc = doc["messages"]
    if isinstance(doc, list):
        return sum(1 for m in doc if isinstance(m, dict) and m.get("role") == "assistant")
    return None
