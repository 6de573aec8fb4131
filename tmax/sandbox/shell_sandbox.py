"""The base every shell-driven sandbox backend shares (local, bwrap, podman, overlay): the
agent's commands go through one `PersistentShell`."""

from __future__ import annotations

import time
from collections.abc import Callable

from tmax.sandbox.base import (
    DEFAULT_COMMAND_TIMEOUT_S, BackgroundProcess, CommandResult, Forked, ForkRecord, SandboxCapabilities, SandboxError,
    SandboxSpec,
)
from tmax.sandbox.fork import (
    RESTORE_HANDED_OVER, ShellState, background_processes, capture_state, handover_vars, restore_state,
)
from tmax.sandbox.shell import PersistentShell


class ShellSandbox:
    """What every backend shares: the agent's commands go through one PersistentShell."""

    kind = ""
    spec: SandboxSpec  # every backend's own
    shell: PersistentShell | None = None
    # A `copy_in` costs about what a process start inside does (the overlay sandbox writes
    # through the episode's root); False where it is an API call of its own (podman).
    copy_is_cheap = False
    capabilities = SandboxCapabilities()
    # A fork's state for the new shell's environment (`fork.handover_vars`), until restored.
    handover: dict[str, str] = {}

    @classmethod
    def prestart(cls) -> None:
        """Start, in the background, what sandboxes of this kind will need (a service), so a
        caller overlaps it with other work; errors surface at the first real use."""

    def _shell(self) -> PersistentShell:
        if self.shell is None:
            raise SandboxError("sandbox is not started (or was started without a shell: SandboxSpec.shell=False)")
        return self.shell

    def run(self, command: str, timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S) -> CommandResult:
        return self._shell().run(command, timeout)

    def _close_shell(self) -> None:
        """End the agent's shell, once; the backend's `close` then ends what it started."""
        if self.shell is not None:
            self.shell.close()
            self.shell = None

    def interrupt(self, force: bool = False) -> None:
        if self.shell is not None:
            self.shell.interrupt(force)

    def watch_output(self, listener: Callable[[str], None] | None) -> None:
        """Show each command's output as it arrives (`PersistentShell.on_output`); None: stop."""
        self._shell().on_output = listener

    # -- fork (`sandbox.fork`) ------------------------------------------------------------

    def fork(self) -> Forked:
        raise SandboxError(f"a {self.kind or 'this'} sandbox cannot fork (its capabilities say so)")

    def _process_root(self) -> int | None:
        """The host pid every process of this sandbox descends from (the shell's own process
        where the sandbox has no init of its own)."""
        return self._shell().pid

    def background(self) -> list[BackgroundProcess]:
        """The processes running in this sandbox other than its shell."""
        return background_processes(self._process_root(), self._shell().inner_pid)

    def _fork_state(self) -> tuple[float, ShellState, list[BackgroundProcess]]:
        """What a fork reads of the parent first: its start time, shell state, background processes."""
        t0 = time.monotonic()
        return t0, capture_state(self._shell()), self.background()

    def _handing_over(self, state: ShellState) -> None:
        """The next start's shell is to take `state` (`_restored` after)."""
        self.handover = handover_vars(state)

    def _after_start(self) -> str:
        """What the next shell runs once set up, in its start (`PersistentShell.after_start`): the
        state handed over in its environment taken."""
        return RESTORE_HANDED_OVER if self.handover else ""

    def _restored(self, state: ShellState) -> str:
        """Put `state` into the shell this sandbox started since `_handing_over` (in its start,
        where it ran `_after_start`); it prints cwd=."""
        shell = self._shell()
        if shell.after_start:
            if shell.after_start_output is None:
                raise SandboxError("fork: the new shell did not take the parent's state")
            said = shell.after_start_output.strip()
        else:
            said = restore_state(shell, state, bool(self.handover))
        self.handover = {}
        shell.start_vars, shell.after_start, shell.after_start_output = {}, "", None  # a restart takes its own
        return said

    def _forked(self, child: ShellSandbox, state: ShellState, background: list[BackgroundProcess], t0: float,
                layers: int = 0) -> Forked:
        """`child` (started since `_handing_over(state)`, its shell new) put in `state`; closed if
        that fails."""
        try:
            said = child._restored(state)
        except BaseException:
            child.close()
            raise
        cwd = said.partition("cwd=")[2].strip()
        record = ForkRecord(kind=self.kind, cwd=cwd, exported=state.exported_names(),
                            functions=state.function_names(), aliases=state.alias_names(), background=background,
                            workdir=child.spec.workdir, layers=layers, seconds=time.monotonic() - t0)
        return Forked(child, record)
