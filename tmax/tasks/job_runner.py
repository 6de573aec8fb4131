"""One resumable job runner: bench jobs (`tasks.job`, one item per trial) and corpus jobs
(`tmax data validate | generate | solve`, one item per task or slot) run through it.

A job is a list of items (`JobItem`): a name, a call `fn(*args)` and an identity (what the
item stands for, e.g. its task's content hash and the settings). A `ResultStore` says which
items finished before: their results are read back and they are skipped; what an unfinished
one left behind is cleared by the store and the item runs again. Each new result is kept by
the store as soon as its item ends, atomically (`ResultFiles`: `<dir>/<name>.json`; a bench
trial writes its own result.json), so a rerun, or one after a crash, resumes where it stopped.

Items run on a backend in their order, at most `slots` at once. Backends (anything with
`slots`, `submit(fn, *args) -> concurrent.futures.Future` and `close()`):
    LocalBackend   a thread pool on this machine (the items spend their time in podman,
                   bwrap, the model server and the verifier's processes, not in Python)
    a Ray backend  tasks on every node of a cluster; it lives with the rest of the Ray code
                   in `training.cluster.corpus_backend` and the CLI passes it in (this layer
                   does not import Ray)

An item that raises stops the run with `JobError`. Ctrl-C: `on_interrupt` is told first (to
stop what runs), items not started are dropped, a backend the runner made is closed (the
local one waits for the running items to end), and the KeyboardInterrupt goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from tmax.common.files import read_json
from tmax.common.records import JobItemResult, write_record

WAIT_S = 0.5  # the longest the runner waits at once, so Ctrl-C is seen at once


class JobError(RuntimeError):
    """A job that cannot run as asked (its directory, its configuration), or one of its
    items raised (the items' own failures are results)."""


class Backend(Protocol):
    slots: int

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future: ...

    def close(self) -> None: ...


class LocalBackend:
    def __init__(self, slots: int = 2):
        self.slots = max(1, slots)
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="tmax-job")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class JobItem:
    name: str
    fn: Callable[..., Any]
    args: tuple
    identity: str = ""  # a result kept for another identity is stale: the item runs again


@dataclass
class Finished:
    name: str
    result: Any
    resumed: bool  # read back from an earlier run, not run now
    seconds: float


class ResultStore(Protocol):
    def prior(self, item: JobItem) -> Any | None:
        """The item's result when it finished before; else None, and what it left is cleared."""

    def save(self, item: JobItem, result: Any) -> None:
        """Keep a new result (atomically), as soon as its item ends."""


class ResultFiles:
    """Results as `<dir>/<name>.json` = {"identity": ..., "result": ...}; a result counts as
    finished when its identity matches and `done(result)` (e.g. no infrastructure error)."""

    def __init__(self, directory: Path, done: Callable[[Any], bool] = lambda result: True):
        self.dir, self.done = Path(directory), done

    def prior(self, item: JobItem) -> Any | None:
        try:
            kept = JobItemResult.model_validate(read_json(self.dir / f"{item.name}.json"))
        except ValidationError:  # none, or cut short: the item runs again
            return None
        if kept.identity != item.identity or kept.result is None:
            return None
        try:
            return kept.result if self.done(kept.result) else None
        except ValidationError:  # a result `done` cannot read (an older shape): the item runs again
            return None

    def save(self, item: JobItem, result: Any) -> None:
        write_record(self.dir / f"{item.name}.json", JobItemResult(identity=item.identity, result=result))


class JobRunner:
    """Runs a job's items, resumably (see the module docstring). Without a backend the
    runner makes a `LocalBackend` of `slots` threads and closes it when a run ends."""

    def __init__(self, store: ResultStore, backend: Backend | None = None, *, slots: int = 1,
                 on_interrupt: Callable[[], None] | None = None):
        self.store, self.backend, self.slots, self.on_interrupt = store, backend, slots, on_interrupt

    def pending(self, items: list[JobItem]) -> tuple[list[JobItem], dict[str, Any]]:
        """(the items to run, in order; {name: result} of those that finished before)."""
        todo, prior = [], {}
        for item in items:
            result = self.store.prior(item)
            if result is None:
                todo.append(item)
            else:
                prior[item.name] = result
        return todo, prior

    def run(self, items: list[JobItem], *, on_start: Callable[[JobItem], None] | None = None,
            on_finished: Callable[[Finished], None] | None = None) -> dict[str, Any]:
        """Every item not finished before; {name: result} of all of them (`on_finished` is
        told of the ones read back first, then of each as it ends)."""
        todo, prior = self.pending(items)
        for name, result in prior.items():
            if on_finished:
                on_finished(Finished(name, result, True, 0.0))
        return {**prior, **self.execute(todo, on_start=on_start, on_finished=on_finished)}

    def execute(self, todo: list[JobItem], *, on_start: Callable[[JobItem], None] | None = None,
                on_finished: Callable[[Finished], None] | None = None) -> dict[str, Any]:
        """Run `todo` (items known not to be finished): {name: result}."""
        backend = self.backend or LocalBackend(self.slots)
        out: dict[str, Any] = {}
        running: dict[Future, tuple[JobItem, float]] = {}
        queue = list(reversed(todo))
        try:
            while queue or running:
                while queue and len(running) < backend.slots:  # a start time is when it was handed out
                    item = queue.pop()
                    if on_start:
                        on_start(item)
                    running[backend.submit(item.fn, *item.args)] = (item, time.monotonic())
                finished, _ = wait(list(running), timeout=WAIT_S, return_when=FIRST_COMPLETED)
                for fut in finished:
                    item, t0 = running.pop(fut)
                    out[item.name] = self._finish(fut, item, t0, on_finished)
        except KeyboardInterrupt:
            if self.on_interrupt:
                self.on_interrupt()
            raise
        finally:
            for fut in running:
                fut.cancel()
            if self.backend is None:
                backend.close()
        return out

    def _finish(self, fut: Future, item: JobItem, t0: float, on_finished: Callable[[Finished], None] | None) -> Any:
        try:
            result = fut.result()
        except Exception as e:
            raise JobError(f"job {item.name} failed: {type(e).__name__}: {e}") from e
        self.store.save(item, result)
        if on_finished:
            on_finished(Finished(item.name, result, False, time.monotonic() - t0))
        return result
