"""A real, persistent, interactive bash session driven through a pty.

One bash process lives for the whole episode, so cwd, exported and plain variables,
functions, aliases, `set` options, traps and background jobs carry over between
commands, exactly as in a terminal. The same class drives host bash, `bwrap ... bash`
and `podman exec -it CID bash`: only the argv differs.

How a command is typed in and where its output ends (a tagged prompt): `shell_protocol`.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import threading
import time
from collections.abc import Callable

from tmax.sandbox.base import DEFAULT_COMMAND_TIMEOUT_S, CommandResult, SandboxError
from tmax.sandbox.hostexec import on_lasting_thread
from tmax.sandbox.ptyspawn import PtyProcess
from tmax.sandbox.shell_output import BoundedOutput, clean_output
from tmax.sandbox.shell_protocol import Collected, PromptReader, command_line
from tmax.sandbox.shell_setup import (
    INIT_VAR, SETUP_VAR, init_script, restore_state_script, restored_note, setup_script,
)

BASH_ARGV = ["bash", "--norc", "--noprofile"]
DEFAULT_MAX_OUTPUT_CHARS = 1_000_000  # head + tail kept per command; the rest is counted
START_TIMEOUT_S = 30.0
INTERRUPT_GRACE_S = 5.0  # how long the prompt may take to return after Ctrl-C


class PersistentShell:
    """An interactive bash on a pty. Not safe for concurrent `run` calls; `interrupt`
    may be called from any thread."""

    def __init__(
        self,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        *,
        spawn_env: dict[str, str] | None = None,
        spawn_cwd: str | None = None,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        start_timeout: float = START_TIMEOUT_S,
        kill_inner: Callable[[int], None] | None = None,
        kill_foreground_inner: Callable[[int], None] | None = None,
        interrupt_grace_s: float = INTERRUPT_GRACE_S,
        spawn: Callable[[list[str], dict[str, str]], PtyProcess] | None = None,
    ):
        """argv: the process to spawn (ends in `bash --norc --noprofile`).
        env: variables exported inside the shell. workdir: initial cwd inside.
        spawn_env / spawn_cwd: environment and cwd of the spawned argv on the host.
        kill_inner: kills the shell's pid *inside* the sandbox when the spawned client
        cannot (a `podman exec` client's death does not end the process it started).
        kill_foreground_inner: SIGKILLs the foreground process group of the shell with
        that inner pid, where the pty seen from the host is not the shell's own (podman);
        elsewhere the group is found on the pty and killed from the host.
        spawn: starts argv on a pty some other way (an episode helper's, `sandbox.overlay`),
        given only the shell's own variables (TERM, PS1, ...), never this host's environment."""
        self.argv = list(argv or BASH_ARGV)
        self.env = dict(env or {})
        self.workdir = workdir
        self.spawn_env = spawn_env
        # Variables bash starts with beyond the shell's own (a fork's state, `sandbox.fork`):
        # in the environment they cost nothing to send, where text typed into the pty goes
        # through readline a character at a time.
        self.start_vars: dict[str, str] = {}
        # The setup (`setup_script`) likewise, where the sandbox puts `setup_vars()` into bash's
        # environment (the spawn's, or bwrap's jail's); typed in elsewhere (a `podman exec`,
        # whose environment stays outside the container).
        self.setup_in_env = False
        # Bash run once the shell is set up (a fork's state put back) and what it printed.
        self.after_start = ""
        self.after_start_output: str | None = None
        self.spawn_cwd = spawn_cwd
        self.max_output_chars = max_output_chars
        self.start_timeout = start_timeout
        self.kill_inner = kill_inner
        self.kill_foreground_inner = kill_foreground_inner
        self._shell_pgrp: int | None = None  # the shell's own process group, seen from the host
        self.interrupt_grace_s = interrupt_grace_s
        self.spawn = spawn
        self.tag = secrets.token_hex(8)
        self._reader = PromptReader(self.tag, max_output_chars)
        self._child: PtyProcess | None = None
        self._seq = 0
        self._write_lock = threading.Lock()
        self._running = False
        self._interrupted = False
        self.inner_pid: int | None = None
        self.restarts = 0
        self.start_s = 0.0
        # Where the shell writes its cwd, exported variables and options at the start of every
        # command line (builtins only: no process), so a restarted shell can take them back.
        self.state_file = f"/tmp/.tmax-shell-{self.tag}"
        # Called from the reading thread while a command of `run` runs: each piece of its output
        # as it arrives, and "" about twice a second when nothing does (for elapsed-time displays).
        # What `run` returns is the same either way.
        self.on_output: Callable[[str], None] | None = None
        self._streaming = False

    # -- lifecycle ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._child is not None and self._child.isalive()

    def start(self) -> None:
        t0 = time.monotonic()
        shell_vars = dict(TERM="dumb", PS1="", PS2="", PROMPT_COMMAND="", HISTFILE="/dev/null", **self.start_vars,
                          **(self.setup_vars() if self.setup_in_env else {}))
        base_env = {**(os.environ if self.spawn_env is None else self.spawn_env), **shell_vars}
        spawn = self.spawn or (lambda argv, _vars: PtyProcess(argv, base_env, self.spawn_cwd))
        try:
            self._child = on_lasting_thread(lambda: spawn(self.argv, shell_vars))
        except OSError as e:
            raise SandboxError(f"could not start shell {shlex.join(self.argv)}: {e}") from e
        self._reader.reset()
        self._seq = 0
        first = self._set_up()
        self.inner_pid = int(first[0]) if first and first[0].isdigit() else None
        try:
            # At its prompt the shell owns the terminal: a command runs in another group.
            self._shell_pgrp = os.tcgetpgrp(self._child.child_fd)
        except OSError:
            self._shell_pgrp = None
        self.start_s = time.monotonic() - t0

    def _set_up(self) -> list[str]:
        """The init, the setup, the cd and `after_start`, in one line and one answer where they
        are in the environment (`setup_vars`: each round trip through the pty costs a few
        milliseconds of a fork's start); else the init typed in, then the rest. The pid."""
        done, deadline = f"__tmax_{self.tag}_", time.monotonic() + self.start_timeout  # printed after each step
        cd = f"builtin cd -- {shlex.quote(self.workdir)} && " if self.workdir else ""
        rest = (f" then builtin printf '\\n%s\\n' {done}setup; if {cd}builtin printf '%s\\n' {done}cd;"
                f" then builtin eval {shlex.quote(self.after_start)}; fi; fi")
        if self.setup_in_env:
            self._write(f'builtin eval "${INIT_VAR}"; builtin printf \'\\n%s\\n\' {done}init;'
                        f' if builtin eval "${SETUP_VAR}" && builtin unset {SETUP_VAR};{rest}\n')
            out, rc, timed_out, eof = self._collect(None, deadline)
        else:
            self._write(init_script(self.tag) + "\n")
            out, rc, timed_out, eof = self._collect(None, deadline)
            if not (timed_out or eof):
                out, rc, timed_out, eof = self._run_raw(f"builtin printf '\\n%s\\n' {done}init; if {{\n"
                                                        f"{setup_script(self.state_file, self.env)}\n}};{rest}", deadline)
        out = clean_output(out).rpartition(f"\n{done}init\n")[2]  # less what bash printed first (a prompt)
        setup_said, ok, rest_said = out.partition(f"\n{done}setup\n")
        if timed_out or eof or not ok:
            self._kill()
            why = "timed out" if timed_out else "the shell exited" if eof else "its setup failed"
            raise SandboxError(f"shell {shlex.join(self.argv)} did not start or set up ({why}): {setup_said[-2000:]}")
        cd_said, ok, after = rest_said.partition(f"{done}cd\n")
        if not ok:
            self._kill()
            raise SandboxError(f"shell could not cd to {self.workdir}: {cd_said.strip()}")
        self.after_start_output = after if self.after_start else None
        return setup_said.strip().splitlines()[-1:]  # the pid, echoed last

    def setup_vars(self) -> dict[str, str]:
        """The environment that hands bash its setup (`setup_in_env`)."""
        return {INIT_VAR: init_script(self.tag, typed=False), SETUP_VAR: setup_script(self.state_file, self.env)}

    def close(self) -> None:
        # The sandbox owning the shell tears down everything inside it; a shell on this very
        # host (plain bash) leaves its state file in the host's /tmp, so it goes here.
        self._kill(inner=False)
        if self.argv == BASH_ARGV:
            try:
                os.unlink(self.state_file)
            except OSError:
                pass

    def _kill(self, inner: bool = True) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if inner and self.kill_inner is not None and self.inner_pid is not None and child.isalive():
            try:
                self.kill_inner(self.inner_pid)
            except Exception:
                pass  # best effort: the sandbox may already be gone
        try:
            child.close()
        except Exception:
            pass

    def restart(self) -> str:
        """A new shell in place of a dead one, with the cwd, exported variables and options
        the old one had before its last command; returns what was restored and what was lost."""
        self._kill()
        self.restarts += 1
        self.start()
        return self._restore_state()

    def _restore_state(self) -> str:
        res = self._run_raw(restore_state_script(self.state_file), time.monotonic() + self.start_timeout)
        ok = res[1] == 0 and not res[2] and not res[3]
        return restored_note(clean_output(res[0]) if ok else None)

    def run_harness(self, script: str) -> str:
        """Run the harness's own `script` between the agent's commands (no state saved before it,
        `$?` left as the agent's last command set it); its output. SandboxError if the shell
        did not answer."""
        out, _rc, timed_out, eof = self._run_raw(f'{script}\n__tmax_ret "$__tmax_rc"',
                                                 time.monotonic() + self.start_timeout)
        if timed_out or eof:
            raise SandboxError(f"the shell {'did not answer' if timed_out else 'exited'}: {clean_output(out)[-500:]}")
        return clean_output(out)

    @property
    def pid(self) -> int | None:
        """The spawned process's pid as this host sees it (bash itself, or what runs it)."""
        return self._child.pid if self._child is not None else None

    # -- commands ----------------------------------------------------------------

    def run(self, command: str, timeout: float | None = DEFAULT_COMMAND_TIMEOUT_S) -> CommandResult:
        """Run one command; returns its output (stdout and stderr merged by the pty)
        and its exit code. Never raises for the command's own behaviour; raises
        SandboxError only if the shell cannot be (re)started."""
        t0 = time.monotonic()
        pre_note = None
        if not self.alive:
            was_started = self._child is not None or self.restarts > 0 or self.start_s > 0
            if was_started:
                pre_note = f"the shell had exited and was restarted: {self.restart()}"
            else:
                self.start()
        deadline = None if timeout is None else t0 + timeout
        self._interrupted = False
        self._streaming = self.on_output is not None
        try:
            out, rc, timed_out, eof, dropped = self._run_command(command, deadline)
        finally:
            self._streaming = False
        note = pre_note
        if eof:
            status = self._exit_status()
            rc = status if status is not None else 1
            note = f"the shell exited (status {rc}) and was restarted: {self._restart_quietly()}"
        elif timed_out:
            recovered = self._recover_after_timeout()
            rc = 124
            if recovered:
                note = f"command timed out after {timeout:g} s and was interrupted"
            else:
                note = (f"command timed out after {timeout:g} s; the shell did not respond to Ctrl-C"
                        f" and was restarted: {self._restart_quietly()}")
        elif self._interrupted:
            note = "interrupted"
        return CommandResult(
            output=out, exit_code=rc, timed_out=timed_out, note=note,
            duration_s=time.monotonic() - t0, dropped_chars=dropped,
        )

    def interrupt(self, force: bool = False) -> None:
        """Ctrl-C to the foreground command; with `force`, SIGKILL to its whole process
        group at once (a program may catch or ignore Ctrl-C). Ignored while no command
        runs, because Ctrl-C at an idle prompt would print a stray prompt."""
        if not self._running or self._child is None:
            return
        self._interrupted = True
        if force:
            # No lock: this may run in a signal handler on a thread that holds it.
            self._kill_foreground()
            return
        with self._write_lock:
            try:
                if self._running and self._child is not None:
                    os.write(self._child.child_fd, b"\x03")
            except OSError:
                pass

    def _kill_foreground(self) -> None:
        if self.kill_foreground_inner is not None:
            if self.inner_pid is not None:
                try:
                    self.kill_foreground_inner(self.inner_pid)
                except Exception:
                    pass  # best effort: the caller falls back to a restart
            return
        try:
            group = os.tcgetpgrp(self._child.child_fd) if self._child is not None else -1
            if group > 0 and group != self._shell_pgrp:
                os.killpg(group, signal.SIGKILL)
        except OSError:
            pass  # the group is gone already

    # -- internals ---------------------------------------------------------------

    def _write(self, text: str) -> None:
        assert self._child is not None
        data = text.encode("utf-8", errors="replace")
        with self._write_lock:
            self._child.send(data)

    def _run_raw(self, command: str, deadline: float | None) -> tuple[str, int, bool, bool]:
        out, rc, timed_out, eof, _ = self._run_command(command, deadline, save=False)
        return out, rc, timed_out, eof

    def _run_command(self, command: str, deadline: float | None, save: bool = True) -> tuple[str, int, bool, bool, int]:
        if self._child is None:
            raise SandboxError("shell is not started")
        self._seq += 1
        text = command_line(self.tag, self._seq, command, save)
        buf = BoundedOutput(self.max_output_chars)
        self._running = True
        try:
            try:
                self._write(text)
            except OSError:
                return "", 1, False, True, 0
            _, rc, timed_out, eof = self._collect(self._seq, deadline, buf)
        finally:
            self._running = False
        out, dropped = buf.text()
        return out, rc, timed_out, eof, dropped

    def _collect(self, seq: int | None, deadline: float | None, buf: BoundedOutput | None = None) -> Collected:
        """Read until the prompt for `seq` (None: any prompt), streaming a command of `run`."""
        assert self._child is not None
        return self._reader.collect(self._child, seq, deadline, buf, self.on_output if self._streaming else None)

    def _recover_after_timeout(self) -> bool:
        """Ctrl-C, then SIGKILL to the command's process group (a program may catch or
        ignore Ctrl-C), each time waiting for this command's prompt; True if the shell
        answered."""
        for force in (False, True):
            if self._child is None or not self._child.isalive():
                return False
            self._running = True
            try:
                if force:
                    self._kill_foreground()
                else:
                    with self._write_lock:
                        os.write(self._child.child_fd, b"\x03")
                sink = BoundedOutput(4096)
                _, _, timed_out, eof = self._collect(self._seq, time.monotonic() + self.interrupt_grace_s, sink)
            except OSError:
                return False
            finally:
                self._running = False
            if eof:
                return False
            if not timed_out:
                return True
        return False

    def _exit_status(self) -> int | None:
        child = self._child
        if child is None:
            return None
        try:
            child.close()
        except Exception:
            pass
        if child.exitstatus is not None:
            return child.exitstatus
        if child.signalstatus is not None:
            return 128 + child.signalstatus
        return None

    def _restart_quietly(self) -> str:
        try:
            return self.restart()
        except SandboxError:
            # Leave it dead: the next run() tries again and raises if that fails.
            self._child = None
            return "the new shell did not start yet; the next command tries again"
