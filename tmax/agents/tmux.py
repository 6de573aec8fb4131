"""A tmux session inside a sandbox, driven through one-off `exec` calls (Terminus-2 style).

The server itself is started from the sandbox's persistent shell, so it lives as long as the
sandbox: in bwrap every `exec` is a jail of its own, and a server started there would die
with it. The clients reach it through its socket in the shared /tmp.

Task images rarely ship tmux and trials run offline, so when a container has none the
host's tmux binary is copied in with the shared libraries it needs that are not part of
glibc (the base images are the host's Debian release), under a private directory, and
run through a small wrapper that sets LD_LIBRARY_PATH for tmux alone: the shell inside
the session starts without it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tmax.sandbox.base import Sandbox, SandboxError
from tmax.sandbox.shell_setup import NO_TTY_VARS

PRIVATE_DIR = "/tmp/.tmax-tmux"
READY_TIMEOUT_S = 15.0
# glibc's own libraries must come from the sandbox, never from the host.
_GLIBC = re.compile(r"^(libc|libm|libresolv|libpthread|libdl|librt|ld-linux[^.]*)\.so")
_LDD_LINE = re.compile(r"^\s*(\S+) => (/\S+)")


def _host_bundle(dst: Path) -> None:
    """bin/tmux, lib/<non-glibc deps> and the `tmux` wrapper, laid out under dst."""
    binary = shutil.which("tmux")
    if binary is None:
        raise SandboxError("the sandbox has no tmux and neither has the host (apt-get install tmux)")
    (dst / "bin").mkdir(parents=True)
    (dst / "lib").mkdir()
    shutil.copy2(binary, dst / "bin" / "tmux")
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    for line in ldd.splitlines():
        m = _LDD_LINE.match(line)
        if m and not _GLIBC.match(m.group(1)):
            shutil.copy2(m.group(2), dst / "lib" / m.group(1))
    wrapper = dst / "tmux"
    wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={PRIVATE_DIR}/lib exec {PRIVATE_DIR}/bin/tmux "$@"\n')
    wrapper.chmod(0o755)


class TmuxSession:
    def __init__(self, sandbox: Sandbox, workdir: str | None = None, width: int = 160, height: int = 40) -> None:
        self.sandbox = sandbox
        self.workdir = workdir
        self.width, self.height = width, height
        self.socket = f"tmax-{uuid.uuid4().hex[:12]}"  # a private server: never another run's session
        self.argv: list[str] = []

    @property
    def started(self) -> bool:
        return bool(self.argv)

    def _tmux(self, *args: str, timeout: float = 30.0) -> str:
        res = self.sandbox.exec([*self.argv, "-L", self.socket, *args], timeout=timeout)
        if res.exit_code != 0:
            raise SandboxError(f"tmux {args[0]} failed (exit {res.exit_code}): {(res.stderr or res.output)[-500:]}")
        return res.output

    def _find_tmux(self) -> list[str]:
        probe = self.sandbox.exec(["sh", "-c", "command -v tmux"], timeout=30)
        if probe.exit_code == 0 and probe.output.strip():
            return [probe.output.strip()]
        with tempfile.TemporaryDirectory(prefix="tmax-tmux-") as tmp:
            _host_bundle(Path(tmp) / "tmux")
            self.sandbox.copy_in(Path(tmp) / "tmux", PRIVATE_DIR)
        return [f"{PRIVATE_DIR}/tmux"]

    def start(self) -> None:
        self.argv = self._find_tmux()
        shell = "env -u LD_LIBRARY_PATH TERM=xterm-256color bash --login"
        cwd = ["-c", self.workdir] if self.workdir else []
        new = [*self.argv, "-L", self.socket, "new-session", "-d", "-s", "main", "-x", str(self.width),
               "-y", str(self.height), *cwd, shell]
        # The server is started from the sandbox's own shell, not a one-off exec: a bwrap exec is
        # a jail of its own whose processes die with it. The no-terminal settings of that shell
        # stay out of the terminal, where editors and pagers do work.
        unset = " ".join(f"-u {name}" for name in NO_TTY_VARS)
        res = self.sandbox.run(f"env {unset} {shlex.join(new)}", timeout=30)
        if res.exit_code != 0:
            raise SandboxError(f"tmux new-session failed (exit {res.exit_code}): {res.output[-500:]}")
        # Long outputs stay reachable through the history, not only what fits on screen.
        self._tmux("set-option", "-t", "main", "history-limit", "50000")
        # Keys sent before the shell has drawn its prompt would be echoed but run late.
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.capture().strip() and time.monotonic() < deadline:
            time.sleep(0.1)

    def send_keys(self, keys: str) -> None:
        """Key names (`C-c`, `Enter`) are sent as keys, anything else as literal text."""
        self._tmux("send-keys", "-t", "main", keys)

    def _in_server(self, script: str) -> str:
        """Run a shell script where the tmux server runs (`run-shell`), with `#{pane_pid}` and
        other formats filled in: only there are the pane's processes visible (a bwrap exec has
        a pid namespace of its own). Its output comes back through a file in /tmp."""
        out = f"/tmp/.{self.socket}-{uuid.uuid4().hex[:8]}.out"  # Ctrl-C may ask while a step asks too
        run = shlex.join([*self.argv, "-L", self.socket, "run-shell", "-t", "main", f"({script}) > {out} 2>&1"])
        res = self.sandbox.exec(["sh", "-c", f"{run}; cat {out}; rm -f {out}"], timeout=30)
        return res.output

    def foreground_busy(self) -> bool:
        """Whether a job, not the shell, holds the terminal: the terminal's foreground process
        group (field 8 of /proc/PID/stat) is not the shell's."""
        pid, _, group = self._in_server('echo #{pane_pid} $(cut -d" " -f8 /proc/#{pane_pid}/stat)').strip().partition(" ")
        return group.isdigit() and int(group) > 0 and group != pid

    def kill_foreground(self) -> None:
        """SIGKILL the job that holds the terminal (never the shell)."""
        self._in_server('g=$(cut -d" " -f8 /proc/#{pane_pid}/stat);'
                        ' [ "$g" -gt 0 ] && [ "$g" != #{pane_pid} ] && kill -s KILL -- "-$g"')

    def capture(self, history: bool = False) -> str:
        args = ["capture-pane", "-p", "-t", "main"] + (["-S", "-"] if history else [])
        return self._tmux(*args)

    def close(self) -> None:
        if self.started:
            try:
                self.sandbox.exec(["sh", "-c", f"{shlex.join(self.argv)} -L {self.socket} kill-server"], timeout=30)
            except SandboxError:
                pass  # the sandbox is going away anyway
            self.argv = []
