"""One scheduler for corpus jobs (`validate`, `generate`): many independent task jobs, run
on a backend, each job's result written atomically as it finishes, so a rerun (or a crash)
resumes where it stopped.

A job is a picklable call `fn(*args) -> dict` keyed by a name. Its result lands in
`<results>/<name>.json` next to the job's `identity` (what it was run on, e.g. the task's
content hash): a rerun skips every job whose result is there with the same identity and
`done(result)` true (an infrastructure error is not done: it is run again), and runs
the rest.

Backends (anything with `slots`, `submit(fn, *args) -> concurrent.futures.Future` and
`close()`):
    LocalBackend   a thread pool on this machine (the jobs spend their time in podman,
                   bwrap and the verifier's processes, not in Python)
    a Ray backend  tasks on every node of a cluster; it lives with the rest of the Ray code
                   in `training.cluster.corpus_backend` and the CLI passes it in (this layer
                   does not import Ray)
"""

from __future__ import annotations

import json
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from tmax.common.files import write_json_atomic


class Backend(Protocol):
    slots: int

    def submit(self, fn: Callable[..., dict], *args: Any) -> Future: ...

    def close(self) -> None: ...


class LocalBackend:
    def __init__(self, slots: int = 2):
        self.slots = max(1, slots)
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="tmax-corpus")

    def submit(self, fn: Callable[..., dict], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class Job:
    name: str
    fn: Callable[..., dict]
    args: tuple
    identity: str = ""  # a result for another identity is stale


@dataclass
class Finished:
    name: str
    result: dict
    resumed: bool  # read back from an earlier run, not run now
    seconds: float


class JobError(RuntimeError):
    """A job raised: the scheduler's caller decides (the job's own failures are results)."""


def read_result(results: Path, job: Job) -> dict | None:
    path = results / f"{job.name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("identity") != job.identity:
        return None
    return data.get("result")


def run_jobs(jobs: list[Job], results: Path, backend: Backend, *, done: Callable[[dict], bool] = lambda r: True,
             on_finished: Callable[[Finished], None] | None = None) -> dict[str, dict]:
    """Run every job not finished before; {name: result} of all of them."""
    results.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    todo: list[Job] = []
    for job in jobs:
        prior = read_result(results, job)
        if prior is not None and done(prior):
            out[job.name] = prior
            if on_finished:
                on_finished(Finished(job.name, prior, True, 0.0))
        else:
            todo.append(job)
    running: dict[Future, tuple[Job, float]] = {}
    queue = list(reversed(todo))
    try:
        while queue or running:
            # at most `slots` jobs in flight: a job's start time is when it was handed out
            while queue and len(running) < backend.slots:
                job = queue.pop()
                running[backend.submit(job.fn, *job.args)] = (job, time.monotonic())
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in finished:
                job, t0 = running.pop(fut)
                try:
                    result = fut.result()
                except Exception as e:
                    raise JobError(f"job {job.name} failed: {type(e).__name__}: {e}") from e
                write_json_atomic(results / f"{job.name}.json", {"identity": job.identity, "result": result})
                out[job.name] = result
                if on_finished:
                    on_finished(Finished(job.name, result, False, time.monotonic() - t0))
    finally:
        for fut in running:
            fut.cancel()
    return out
