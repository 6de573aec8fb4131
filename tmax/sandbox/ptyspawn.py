"""A process on its own pseudo-terminal, started without forking the caller.

pexpect sets up a child's terminal in a fork of the calling process. A driver that holds
torch and a gigabyte of memory pays for that fork on every shell it starts (its page
tables copied, then a fault on each page it writes again), and pexpect's close sleeps a
tenth of a second or more per shell. Here the pty is opened and configured in this
process (no echo, a window size), the child is started by `subprocess.Popen`, which uses
vfork when no Python code has to run in the child (`hostexec.popen_default_signals`), and
`setsid --ctty` makes the pty the child's controlling terminal before it execs argv, as a
login terminal would be.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import shutil
import signal
import struct
import termios
import time

from tmax.sandbox.hostexec import popen_default_signals

# How long close() gives the child to end after its terminal hangs up before SIGKILL.
HANGUP_GRACE_S = 0.2


class ReadTimeout(Exception):
    """Nothing to read within the timeout."""


class PtyProcess:
    """argv on a new pty whose master side this object holds. `read_nonblocking` raises
    `ReadTimeout` when nothing arrives in time and `EOFError` once the terminal is closed."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None = None,
                 dimensions: tuple[int, int] = (50, 200)):
        program = shutil.which(argv[0], path=env.get("PATH", os.defpath))
        setsid = shutil.which("setsid")
        if program is None or setsid is None:
            missing = argv[0] if program is None else "setsid (util-linux)"
            raise FileNotFoundError(errno.ENOENT, f"{missing}: command not found")
        master, slave = os.openpty()
        try:
            attrs = termios.tcgetattr(slave)
            attrs[3] &= ~termios.ECHO  # lflag: what is sent is not echoed back
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", dimensions[0], dimensions[1], 0, 0))
            self.proc = popen_default_signals([setsid, "--ctty", program, *argv[1:]], stdin=slave, stdout=slave,
                                              stderr=slave, env=env, cwd=cwd)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)  # the child's copies only: EOF here once they are all closed
        self._init_reader(master)

    def _init_reader(self, master: int) -> None:
        self.child_fd = master
        self._poll = select.poll()
        self._poll.register(master, select.POLLIN | select.POLLHUP | select.POLLERR)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.child_fd, view):]

    def read_nonblocking(self, size: int, timeout: float) -> bytes:
        if self.child_fd < 0:
            raise EOFError("the terminal is closed")
        if not self._poll.poll(max(0, int(timeout * 1000))):
            raise ReadTimeout
        try:
            data = os.read(self.child_fd, size)
        except OSError as e:
            if e.errno != errno.EIO:  # EIO: every slave side is closed
                raise
            data = b""
        if not data:
            raise EOFError("the terminal is closed")
        return data

    def isalive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Hang up the terminal (its session leader gets SIGHUP), then SIGKILL the child
        if it is still there after a short grace."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1
        deadline = time.monotonic() + HANGUP_GRACE_S
        for sig in (signal.SIGHUP, signal.SIGCONT):
            self._signal(sig)
        while self.isalive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.isalive():
            self._signal(signal.SIGKILL)
            self.proc.wait()

    def _signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    @property
    def exitstatus(self) -> int | None:
        rc = self.proc.returncode
        return rc if rc is not None and rc >= 0 else None

    @property
    def signalstatus(self) -> int | None:
        rc = self.proc.returncode
        return -rc if rc is not None and rc < 0 else None
