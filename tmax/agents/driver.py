"""One episode driver: how `tmax run`, bench trials and training rollouts run the agent loop.

    with EpisodeDriver(policy, sandbox, harness, config, recorder=..., timeout=900, cancel=event) as driver:
        result = driver.run(task)        # an `EpisodeResult`; `follow_up` continues it

The driver owns what the loop (`agents.loop.Agent`) does not:

* the harness's lifetime: it is closed when the driver closes (what it started in the
  sandbox, such as terminus-2's tmux server, goes with it);
* the deadline (`timeout`, the agent's time) and cancellation (`cancel`, an Event): either
  sets the loop's stop signal and interrupts the running command through the harness
  (again, forcefully, every `FORCE_EVERY_S` while the loop has not ended); the loop ends as
  `stopped` at its next step boundary;
* a model call that hangs past the deadline: with a deadline the loop runs on a thread of
  its own, and once `grace_s` more have passed it is abandoned (`abandoned`; the caller, e.g.
  a bench trial, goes on to its verifier); without one it runs on the calling thread, so
  Ctrl-C reaches it (`tmax run`);
* the time split: model time and command time, summed from the steps' timing records;
* `/compact` (`compact`): now when the loop is idle, else at the loop's next step boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tmax.agents.compaction import CompactionRecord, ContextUse
from tmax.agents.harness import Harness
from tmax.agents.loop import Agent, AgentHooks, AgentResult
from tmax.agents.agent_settings import AgentSettings
from tmax.agents.policy import Policy, Usage
from tmax.agents.recorder import Recorder, SavedRun
from tmax.common.records import AgentStatus, StepTiming
from tmax.sandbox.base import Sandbox

ABANDON_GRACE_S = 60.0  # a model call still running this long after the deadline is left behind
FORCE_EVERY_S = 5.0  # after a stop, the running command is killed if it outlives this
WATCH_EVERY_S = 0.2


@dataclass
class EpisodeResult:
    """How one drive of the loop ended. `status` is the loop's (`AgentResult.status`), or
    `abandoned` when a model call outlived the deadline and its grace."""

    status: AgentStatus
    steps: int
    usage: Usage
    messages: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False  # the deadline passed before the loop ended
    cancelled: bool = False  # `cancel` was set before the loop ended
    agent_s: float = 0.0  # wall time of this drive
    llm_s: float = 0.0  # of which waiting for the model
    exec_s: float = 0.0  # and commands running in the sandbox
    command_s: list[float] = field(default_factory=list)  # each command's round trip (issue -> output back)
    turn_outcomes: list[str] = field(default_factory=list)  # per model turn, in order (`turn_outcome`)

    @property
    def stopped(self) -> bool:
        """Ended by the deadline or a cancel, not by the agent."""
        return self.timed_out or self.cancelled

    @property
    def abandoned(self) -> bool:
        return self.status == AgentStatus.ABANDONED


def turn_outcome(record: StepTiming) -> str:
    """What one model turn came to, from the loop's timing record of it: "format" (no valid
    call), "rejected", "sandbox_error", "failed" (the command exited non-zero) or "ok"."""
    if record.format_error:
        return "format"
    if record.rejected:
        return "rejected"
    if record.sandbox_error is not None:
        return "sandbox_error"
    return "failed" if (record.return_code or 0) != 0 else "ok"


class EpisodeDriver:
    """The agent loop on `sandbox` with `harness`, driven to its end (see the module doc)."""

    def __init__(self, policy: Policy, sandbox: Sandbox, harness: Harness, config: AgentSettings | None = None, *,
                 recorder: Recorder | None = None, hooks: AgentHooks | None = None, timeout: float | None = None,
                 cancel: threading.Event | None = None, grace_s: float = ABANDON_GRACE_S,
                 instructions: str | None = None) -> None:
        self.harness, self.sandbox = harness, sandbox
        self.timeout, self.cancel, self.grace_s = timeout, cancel, grace_s
        self.stop = threading.Event()
        self.agent = Agent(policy, sandbox, config, recorder, hooks, harness=harness, stop=self.stop,
                           instructions=instructions)
        self._why: str | None = None  # "deadline" | "cancel" once the stop was given
        self._abandoned = False
        self._driving = False

    @property
    def usage(self) -> Usage:
        """The running totals of the current episode (follow-ups included)."""
        return self.agent.usage

    @property
    def steps(self) -> int:
        return self.agent.steps

    @property
    def context_use(self) -> ContextUse:
        return self.agent.context_use

    def compact(self, focus: str | None = None) -> CompactionRecord | None:
        """Compact the session: now when the loop is idle (the record), else before the
        loop's next model call (None)."""
        if self._driving:
            self.agent.request_compaction(focus)
            return None
        return self.agent.compact(focus, "manual")

    def run(self, task: str) -> EpisodeResult:
        """A fresh episode on `task`."""
        return self._drive(lambda: self.agent.run(task), first_timing=0)

    def follow_up(self, text: str) -> EpisodeResult:
        """The same conversation and shell, with a new user message."""
        return self._drive(lambda: self.agent.follow_up(text), first_timing=len(self.agent.timing))

    def resume(self) -> EpisodeResult:
        """Continue the episode a stop ended (`Agent.resume`): a branch of a forked episode."""
        return self._drive(self.agent.resume, first_timing=len(self.agent.timing))

    def load(self, saved: SavedRun) -> None:
        """Adopt a saved conversation (`tmax run --resume`), then `follow_up`."""
        self.agent.load(saved)

    # ---- driving ----------------------------------------------------------------------

    def _drive(self, call: Callable[[], AgentResult], first_timing: int) -> EpisodeResult:
        if self._abandoned:
            raise RuntimeError("this driver's loop was abandoned; open a new one")
        self.stop.clear()
        self._why = None
        t0 = time.monotonic()
        done = threading.Event()
        watcher = None
        if self.timeout is not None or self.cancel is not None:
            deadline = None if self.timeout is None else t0 + self.timeout
            watcher = threading.Thread(target=self._watch, args=(done, deadline), daemon=True,
                                       name="tmax-episode-watch")
            watcher.start()
        self._driving = True
        try:
            result = call() if self.timeout is None else self._on_worker(call)
        finally:
            self._driving = False
            done.set()
            if watcher is not None:
                watcher.join()
        return self._result(result, time.monotonic() - t0, first_timing)

    def _on_worker(self, call: Callable[[], AgentResult]) -> AgentResult | None:
        """The loop on its own thread; None when it is abandoned past the deadline + grace."""
        assert self.timeout is not None
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["result"] = call()
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        worker = threading.Thread(target=work, daemon=True, name="tmax-agent")
        worker.start()
        worker.join(self.timeout + self.grace_s)
        if worker.is_alive():
            # A model call cannot be interrupted from outside: the loop is left to end on
            # its own (the stop is set, so nothing more runs once the call returns).
            self._give_stop("deadline")
            self._abandoned = True
            return None
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _watch(self, done: threading.Event, deadline: float | None) -> None:
        """Give the stop at the deadline or on cancel; then, while the loop has not ended,
        kill what the command left running."""
        while True:
            if self.cancel is not None and self.cancel.is_set():
                self._give_stop("cancel")
                break
            if deadline is not None and time.monotonic() >= deadline:
                self._give_stop("deadline")
                break
            if done.wait(WATCH_EVERY_S):
                return
        while not done.wait(FORCE_EVERY_S):
            self._interrupt(force=True)

    def _give_stop(self, why: str) -> None:
        if self._why is None:
            self._why = why
        self.stop.set()
        self._interrupt(force=False)

    def _interrupt(self, force: bool) -> None:
        try:
            self.harness.interrupt(self.sandbox, force=force)
        except Exception:  # a sandbox already gone: the loop finds out on its own
            pass

    def _result(self, result: AgentResult | None, wall_s: float, first_timing: int) -> EpisodeResult:
        timing = list(self.agent.timing)[first_timing:]
        command_s = [t.bash_s for t in timing if t.bash_s is not None]
        split = {"agent_s": round(wall_s, 3), "llm_s": round(sum(t.llm_s or 0.0 for t in timing), 3),
                 "exec_s": round(sum(command_s), 3), "command_s": command_s,
                 "turn_outcomes": [turn_outcome(t) for t in timing if t.step is not None]}
        stopped = {"timed_out": self._why == "deadline", "cancelled": self._why == "cancel"}
        if result is None:
            error = f"the model call did not return within {self.grace_s:g} s after the deadline"
            return EpisodeResult(AgentStatus.ABANDONED, self.agent.steps, replace(self.agent.usage), list(self.agent.messages),
                                 error, **stopped, **split)
        return EpisodeResult(result.status, result.steps, result.usage, result.messages, result.error,
                             **stopped, **split)

    # ---- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the harness; an abandoned loop keeps it (its thread may still use it)."""
        if not self._abandoned:
            self.harness.close()

    def __enter__(self) -> EpisodeDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
