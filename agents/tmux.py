"""A tmux session inside a sandbox, driven through one-off `exec` calls (Terminus-2 style).

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

from sandbox.base import Sandbox, SandboxError

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
        self._tmux("new-session", "-d", "-s", "main", "-x", str(self.width), "-y", str(self.height), *cwd, shell)
        # Long outputs stay reachable through the history, not only what fits on screen.
        self._tmux("set-option", "-t", "main", "history-limit", "50000")
        # Keys sent before the shell has drawn its prompt would be echoed but run late.
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.capture().strip() and time.monotonic() < deadline:
            time.sleep(0.1)

    def send_keys(self, keys: str) -> None:
        """Key names (`C-c`, `Enter`) are sent as keys, anything else as literal text."""
        self._tmux("send-keys", "-t", "main", keys)

    def _foreground(self) -> tuple[str, str]:
        """(the pane's shell pid, the terminal's foreground process group): field 8 of
        /proc/PID/stat."""
        pid = self._tmux("display-message", "-p", "-t", "main", "#{pane_pid}").strip()
        res = self.sandbox.exec(["sh", "-c", 'cut -d" " -f8 /proc/"$1"/stat', "sh", pid], timeout=30)
        return pid, res.output.strip()

    def foreground_busy(self) -> bool:
        """Whether a job, not the shell, holds the terminal."""
        pid, group = self._foreground()
        return group.isdigit() and int(group) > 0 and group != pid

    def kill_foreground(self) -> None:
        """SIGKILL the job that holds the terminal (never the shell)."""
        pid, group = self._foreground()
        if group.isdigit() and int(group) > 0 and group != pid:
            self.sandbox.exec(["kill", "-KILL", "--", f"-{group}"], timeout=30)

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
