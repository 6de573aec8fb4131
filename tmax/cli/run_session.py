"""One interactive run's sandbox and signals: what `tmax run` opens and closes.

    with RunSession("bwrap", spec, harness, on_terminate=...) as session:
        box = session.start()
        ...  # drive the loop on `box` (`agents.driver.EpisodeDriver`, which closes the harness)

* The sandbox: made and started here; any failure to start is a SandboxError (the
  infrastructure, not the agent), and it is closed on the way out whatever happened.
* Signals: SIGTERM and SIGHUP end the run like a Ctrl-C answered with "quit" (so the
  sandbox is removed) and kill a running command's process group at once. A process
  started in the background by a script inherits SIGINT ignored, and one started by a
  process that blocks it (a Ray worker, some job runners) inherits it blocked: Ctrl-C
  (kill -INT) must still stop a command and the run, so while the session is open SIGINT
  raises KeyboardInterrupt and the three signals are unblocked. The previous handlers and
  signal mask come back on exit.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

from tmax.agents.harness import Harness

from tmax.sandbox import make_sandbox
from tmax.sandbox.base import Sandbox, SandboxError, SandboxSpec

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunSession:
    def __init__(self, kind: str, spec: SandboxSpec, harness: Harness,
                 on_terminate: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self.spec = spec
        self.harness = harness  # SIGTERM interrupts its running action
        self.on_terminate = on_terminate  # told first when SIGTERM/SIGHUP arrives
        self.box: Sandbox | None = None
        self.close_error: str | None = None  # what went wrong while closing, for the caller to show
        self._old_handlers: dict[int, Any] = {}
        self._old_mask: set[signal.Signals] = set()

    def __enter__(self) -> "RunSession":
        self._old_handlers = {s: signal.signal(s, self._terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
        self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        # A blocked signal survives exec and a handler does not unblock it: Ctrl-C would
        # stay pending until the run ends. Threads started later inherit this mask.
        self._old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
        return self

    def start(self) -> Sandbox:
        try:
            self.box = make_sandbox(self.kind, self.spec)
            self.box.start()
        except SandboxError:
            raise
        except Exception as e:  # e.g. a missing binary: still the infrastructure, not the agent
            raise SandboxError(f"could not start the {self.kind} sandbox: {e}") from e
        return self.box

    def _terminate(self, signum: int, frame: FrameType | None) -> None:
        if self.on_terminate is not None:
            self.on_terminate()
        if self.box is not None:
            self.harness.interrupt(self.box, force=True)
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)
        if self.box is None:
            return
        try:
            self.box.close()
        except Exception as e:  # cleanup must not hide the outcome
            self.close_error = f"closing the sandbox failed: {e}"
