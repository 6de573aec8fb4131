"""Load tmax job directories with Harbor's own pydantic models (run with Harbor's Python).

    .venv-harbor/bin/python tests/harbor_check.py JOB_DIR...

Prints one JSON object: how many job results, trial results and ATIF trajectories loaded,
and every failure with its file and error. Exit status 1 when anything failed to load.
It imports nothing from tmax: Harbor needs Python >= 3.12, which tmax's venv may not have.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harbor.models.job.result import JobResult
from harbor.models.trajectories import Trajectory
from harbor.models.trial.result import TrialResult

ATIF_FILE = "trajectory.atif.json"


def check(job_dir: Path, counts: dict, failures: list) -> None:
    def load(model, path: Path, key: str) -> None:
        try:
            model.model_validate_json(path.read_text())
            counts[key] += 1
        except Exception as e:  # every validation problem is reported, not only the first
            failures.append({"file": str(path), "error": str(e)[:2000]})

    load(JobResult, job_dir / "result.json", "jobs")
    for trial in sorted(p for p in job_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (trial / "result.json").is_file():
            load(TrialResult, trial / "result.json", "trials")
        if (trial / "agent" / ATIF_FILE).is_file():
            load(Trajectory, trial / "agent" / ATIF_FILE, "atif")


def main(argv: list[str]) -> int:
    counts = {"jobs": 0, "trials": 0, "atif": 0}
    failures: list[dict] = []
    for arg in argv:
        check(Path(arg), counts, failures)
    print(json.dumps({**counts, "failures": failures}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
