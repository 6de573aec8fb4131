"""Reading any job directory, for reports and comparisons: tmax's own, Harbor's, or another
agent's. A trial another tool wrote gets tmax's outcome fields derived from its result
(`_derive_tmax`): the outcome from the reward and the exception, the category from the
task, the agent's steps from its ATIF trajectory."""

from __future__ import annotations

from pathlib import Path

from tmax.agents.records import TRAJECTORY
from tmax.common.files import read_json
from tmax.tasks.job import JobError
from tmax.tasks.model import load_config
from tmax.tasks.trial import CANCELLED


def load_job_results(job_dir: Path) -> tuple[dict, list[dict]]:
    """(config.json, finished trial results) of any job directory, for reports: tmax's,
    Harbor's, or another agent's. A trial without a readable result.json has not finished
    and is left out; one without tmax's fields gets them derived (`_derive_tmax`)."""
    cfg = read_json(job_dir / "config.json")
    if cfg is None:
        raise JobError(f"{job_dir}: not a job directory (no readable config.json)")
    results = []
    categories: dict[str, str | None] = {}
    for d in sorted(job_dir.iterdir()):
        if d.is_dir() and not d.name.startswith("."):
            r = read_json(d / "result.json")
            if not isinstance(r, dict) or not r.get("task_name") or not r.get("trial_name"):
                continue
            if (r.get("tmax") or {}).get("outcome") == CANCELLED:
                continue
            if not isinstance(r.get("tmax"), dict):
                r["tmax"] = _derive_tmax(r, d, categories)
            results.append(r)
    return cfg, results


def _derive_tmax(r: dict, trial_dir: Path, categories: dict[str, str | None]) -> dict:
    """tmax's outcome fields for a trial another tool wrote: the outcome from the reward and
    exception, the category from the task's task.toml when it is reachable, else from the
    trial config, and the agent's steps from an ATIF trajectory."""
    rewards = (r.get("verifier_result") or {}).get("rewards") or {}
    reward = rewards.get("reward")
    exc = (r.get("exception_info") or {}).get("exception_type")
    if exc == "AgentTimeoutError":
        outcome = "agent_timeout"
    elif exc in ("VerifierTimeoutError", "RewardFileNotFoundError", "RewardFileEmptyError", "VerifierOutputParseError"):
        outcome = "verifier_error"
    elif exc and reward is None:
        outcome = "infra_error"
    else:
        outcome = "pass" if reward is not None and float(reward) >= 1.0 - 1e-9 else "fail"
    task_cfg = ((r.get("config") or {}).get("task") or {})
    key = str(task_cfg.get("path") or r["task_name"])
    if key not in categories:
        categories[key] = _task_category(task_cfg)
    return {"outcome": outcome, "reward": reward, "category": categories[key],
            "agent_steps": _atif_agent_steps(trial_dir / "agent" / TRAJECTORY)}


def _task_category(task_cfg: dict) -> str | None:
    path = task_cfg.get("path")
    if path:
        try:
            category = load_config(Path(path).expanduser() / "task.toml").metadata.get("category")
            if category:
                return str(category)
        except Exception:  # the task is elsewhere or unreadable: fall back to the config
            pass
    return task_cfg.get("category") or (task_cfg.get("metadata") or {}).get("category")


def _atif_agent_steps(path: Path) -> int | None:
    doc = read_json(path) if path.is_file() else None
    if isinstance(doc, dict) and isinstance(doc.get("steps"), list):
        return sum(1 for s in doc["steps"] if isinstance(s, dict) and s.get("source") == "agent")
    return None
