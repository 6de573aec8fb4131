"""Load job directories with Harbor's own code (run with Harbor's Python).

    .venv-harbor/bin/python tests/harbor_check.py JOB_DIR...

For every job: its config.json as Harbor's JobConfig and its result.json as JobResult (and
what `stats.evals` holds), every trial's config.json as TrialConfig and result.json as
TrialResult, every `agent/trajectory.json` as an ATIF Trajectory,
and the answers `harbor view`'s API gives for the job, its config, its trials and their
trajectories (status codes). Prints one JSON object; exit status 1 when anything failed.
It imports nothing from tmax: Harbor needs Python >= 3.12, which tmax's venv may not have.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harbor.models.job.config import JobConfig
from harbor.models.job.result import JobResult
from harbor.models.trajectories import Trajectory
from harbor.models.trial.config import TrialConfig
from harbor.models.trial.result import TrialResult


def _trials(job_dir: Path) -> list[Path]:
    return sorted(p for p in job_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def check_models(job_dir: Path, out: dict) -> None:
    def load(model, path: Path, key: str):
        try:
            obj = model.model_validate_json(path.read_text())
            out[key] += 1
            return obj
        except Exception as e:  # every validation problem is reported, not only the first
            out["failures"].append({"file": str(path), "error": str(e)[:2000]})
            return None

    load(JobConfig, job_dir / "config.json", "job_configs")
    job = load(JobResult, job_dir / "result.json", "jobs")
    if job is not None:
        out["evals"][job_dir.name] = {k: v.model_dump(mode="json") for k, v in job.stats.evals.items()}
        out["tokens"][job_dir.name] = [job.stats.n_input_tokens, job.stats.n_output_tokens]
    for trial in _trials(job_dir):
        if (trial / "config.json").is_file():
            load(TrialConfig, trial / "config.json", "trial_configs")
        if (trial / "result.json").is_file():
            load(TrialResult, trial / "result.json", "trials")
        if (trial / "agent" / "trajectory.json").is_file():
            load(Trajectory, trial / "agent" / "trajectory.json", "atif")


def check_viewer(jobs_dir: Path, job_dirs: list[Path], out: dict) -> None:
    """What `harbor view JOBS_DIR` answers for each job, config, trial and trajectory."""
    from fastapi.testclient import TestClient

    from harbor.viewer.server import create_app

    with TestClient(create_app(jobs_dir, mode="jobs"), raise_server_exceptions=False) as client:
        urls = ["/api/jobs"]
        for job in job_dirs:
            urls += [f"/api/jobs/{job.name}", f"/api/jobs/{job.name}/config", f"/api/jobs/{job.name}/trials"]
            for trial in _trials(job):
                urls += [f"/api/jobs/{job.name}/trials/{trial.name}",
                         f"/api/jobs/{job.name}/trials/{trial.name}/trajectory"]
        for url in urls:
            code = client.get(url).status_code
            out["viewer"][url] = code
            if code != 200:
                out["failures"].append({"url": url, "status": code})


def main(argv: list[str]) -> int:
    out: dict = {"jobs": 0, "job_configs": 0, "trials": 0, "trial_configs": 0, "atif": 0, "evals": {}, "tokens": {},
                 "viewer": {}, "failures": []}
    job_dirs = [Path(a).resolve() for a in argv]
    for job_dir in job_dirs:
        check_models(job_dir, out)
    for parent in sorted({j.parent for j in job_dirs}):
        check_viewer(parent, [j for j in job_dirs if j.parent == parent], out)
    print(json.dumps(out, indent=2))
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
