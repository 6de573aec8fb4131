"""The resumable job runner on its local backend (corpus jobs: results files per item), and
the build-failure classifier."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tmax.tasks.job_runner import JobError, JobItem, JobRunner, LocalBackend, ResultFiles
from tmax.tasks.task_images import classify_build_log

CALLS: list[str] = []
LOCK = threading.Lock()


def work(name: str, status: str, sleep: float = 0.0) -> dict:
    with LOCK:
        CALLS.append(name)
    time.sleep(sleep)
    if status == "raise":
        raise RuntimeError("boom")
    return {"name": name, "status": status}


def test_results_are_written_as_jobs_finish_and_a_rerun_runs_only_the_unfinished(tmp_path):
    CALLS.clear()
    jobs = [JobItem("a", work, ("a", "ok"), "v1"), JobItem("b", work, ("b", "infra"), "v1"),
            JobItem("c", work, ("c", "ok"), "v1")]
    backend = LocalBackend(2)
    runner = JobRunner(ResultFiles(tmp_path, done=lambda r: r["status"] == "ok"), backend)
    try:
        out = runner.run(jobs)
        assert sorted(out) == ["a", "b", "c"] and sorted(CALLS) == ["a", "b", "c"]
        assert json.loads((tmp_path / "a.json").read_text()) == {"identity": "v1", "result": {"name": "a", "status": "ok"}}
        CALLS.clear()
        resumed = []
        jobs[2] = JobItem("c", work, ("c", "ok"), "v2")  # its task changed: a stale result
        runner.run(jobs, on_finished=lambda f: f.resumed and resumed.append(f.name))
        assert sorted(CALLS) == ["b", "c"] and resumed == ["a"]  # b was not done, c is stale
    finally:
        backend.close()


def test_at_most_slots_jobs_run_at_once_and_a_raising_job_stops_the_run(tmp_path):
    CALLS.clear()
    backend = LocalBackend(2)
    t0 = time.monotonic()
    try:
        JobRunner(ResultFiles(tmp_path), backend).run([JobItem(str(i), work, (str(i), "ok", 0.3)) for i in range(4)])
        assert 0.55 < time.monotonic() - t0 < 3.0  # two rounds of two
        with pytest.raises(JobError, match="job bad failed: RuntimeError: boom"):
            JobRunner(ResultFiles(tmp_path / "x"), backend).run([JobItem("bad", work, ("bad", "raise"))])
        assert not (tmp_path / "x" / "bad.json").exists()
    finally:
        backend.close()


@pytest.mark.parametrize("log,kind", [
    ("Step 2/3 : RUN apt-get install -y foo\nE: Unable to locate package foo\nError: building at STEP", "task"),
    ("W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving "
     "'deb.debian.org'\nE: Some index files failed to download", "transient"),
    ("ERROR: Could not install packages due to an OSError: HTTPSConnectionPool(host='pypi.org', port=443): "
     "Max retries exceeded with url: /simple/numpy/", "transient"),
    ("Error: committing container for step: writing blob: no space left on device", "infra"),
    ("python3: can't open file '/app/setup.py': [Errno 2] No such file or directory\nexit status 2", "task"),
])
def test_build_failures_are_classified(log, kind):
    assert classify_build_log(log) == kind
