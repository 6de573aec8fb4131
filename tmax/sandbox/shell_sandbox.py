"""The base every shell-driven sandbox backend shares (local, bwrap, podman, overlay): the
agent's commands go through one `PersistentShell`."""

from __future__ import annotations

from collections.abc import Callable

from tmax.sandbox.base import DEFAULT_COMMAND_TIMEOUT_S, CommandResult, SandboxError
from tmax.sandbox.shell import PersistentShell


class ShellSandbox:
    """What every backend shares: the agent's commands go through one PersistentShell."""

    shell: PersistentShell | None = None
    # A `copy_in` costs about what a process start inside does (the overlay sandbox writes
    # through the episode's root); False where it is an API call of its own (podman).
    copy_is_cheap = False

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
