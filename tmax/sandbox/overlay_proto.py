"""The host's side of the episode helper (`sandbox/helper/`): episodes and the processes in
them.

An episode is a lease: a connection to the helper's control socket that stays open for
the episode's life and brings back an fd of the episode's root. Every process is a
connection to the episode's own socket carrying three fds (a pty slave, or pipes) and the
process's user, cwd, environment and argv; the helper answers with its pid and later its
exit. No podman call is made: the processes are children of the container's main process,
with its cgroup, seccomp profile, capabilities (less the helper's own) and rlimits.
Files go in and out through the root fd (`sandbox.overlay_files`).
"""

from __future__ import annotations

import array
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tmax.sandbox.base import AgentUserError, CommandResult, SandboxError
from tmax.sandbox.hostexec import MAX_EXEC_CHARS
from tmax.sandbox.ptyspawn import PtyProcess

IN_DIR = "/run/tmax-eph"  # the state directory inside the container
IN_BIN = "/run/tmax-eph.bin"  # the helper inside the container
CONNECT_TIMEOUT_S = 30.0
EXIT_GRACE_S = 0.2  # a hung-up shell's wait for its end before its group is killed


class EpisodeSetupError(SandboxError):
    """The helper could not make the episode's environment (a mount the kernel refused, say):
    the task's container cannot serve episodes this way."""


class HostBusy(SandboxError):
    """The host serves as many episodes as it may at once."""


class HostGone(SandboxError):
    """No helper answers in that state directory: the host ended (idle, killed) or never started."""


# sockaddr_un holds 108 bytes: a state directory deep in a long $HOME or $TMPDIR would not fit.
_SUN_PATH_MAX = 107


def connect_unix(sock: socket.socket, path: str | Path) -> None:
    """`sock.connect(path)` for a socket path of any length: a long one is reached through
    its directory's /proc/self/fd entry (a short path to the same directory)."""
    path = str(path)
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        sock.connect(path)
        return
    parent, name = os.path.split(path)
    dir_fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{dir_fd}/{name}")
    finally:
        os.close(dir_fd)


def _recv_line(sock: socket.socket, fds: list[int] | None = None) -> tuple[str, bytes]:
    """One reply line and what came after it; fds sent with it are appended to `fds`."""
    data = b""
    while b"\n" not in data:
        msg, anc, _flags, _addr = sock.recvmsg(512, socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                if fds is None:
                    for fd in got:
                        os.close(fd)
                else:
                    fds.extend(got)
        if not msg:
            break
        data += msg
    line, _, rest = data.partition(b"\n")
    return line.decode(errors="replace").strip(), rest


class EpisodeLease:
    """One episode of the helper in `state_dir` (a host directory), held until `close`; on the
    frozen layer `layer` (a fork: `freeze`; `held`: in a room its freeze kept), else on the
    container's root."""

    def __init__(self, state_dir: Path, episode_id: str, own_net: bool, layer: str | None = None,
                 held: bool = False):
        self.state_dir = Path(state_dir)
        self.id = episode_id
        self.sock_path = str(self.state_dir / f"ep-{episode_id}.sock")
        self.root_fd = -1
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CONNECT_TIMEOUT_S)
        fds: list[int] = []
        try:
            connect_unix(self.sock, self.state_dir / "ctl.sock")
            how = f" {layer}{' held' if held else ''}" if layer else ""
            self.sock.sendall(f"EPISODE {episode_id} {'own' if own_net else 'shared'}{how}\n".encode())
            reply, _ = _recv_line(self.sock, fds)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as e:
            self.sock.close()
            raise HostGone(f"no episode helper in {self.state_dir}: {e}") from e
        except OSError as e:
            self.sock.close()
            raise SandboxError(f"the episode helper did not answer: {e}") from e
        if reply != "READY" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.sock.close()
            if reply == "ERR busy":
                raise HostBusy(f"the host in {self.state_dir} is full")
            if reply.startswith("ERR "):
                raise EpisodeSetupError(f"the episode helper could not set up an episode: {reply[4:]}")
            raise HostGone(f"the episode helper in {self.state_dir} ended without an episode")
        self.root_fd = fds[0]
        self.sock.settimeout(None)

    def peer_pid(self) -> int:
        """The host pid of the episode's pid 1 (the listener of its socket)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(CONNECT_TIMEOUT_S)
            connect_unix(probe, self.sock_path)
            pid, _uid, _gid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                    struct.calcsize("3i")))
        return pid

    def close(self, wait_s: float = 5.0) -> None:
        """End the episode: every process in it is killed, its upper layers deleted. Returns
        once the helper counts it out (its lease closed from the other side), so the host's
        room is free for the next episode."""
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(wait_s)
            while self.sock.recv(256):
                pass
        except OSError:
            pass
        finally:
            self.sock.close()


@dataclass
class FrozenLayer:
    """An ended episode's files, kept read-only for new episodes (`freeze`), and the rooms the
    host keeps for them: held by this connection, until each is taken by an episode on the
    layer (`EpisodeLease(layer=)`), given back (`drop`) or all let go (`release`; a process
    that dies lets go of them too). The layer lives while an episode stands on it."""

    id: str
    depth: int  # frozen layers in its chain (merged into one past the helper's MAX_CHAIN)
    hold: socket.socket

    def drop(self) -> None:
        """One room not needed after all."""
        try:
            self.hold.sendall(b"DROP\n")
        except OSError:
            pass  # the host is gone, and its rooms with it

    def release(self) -> None:
        self.hold.close()


def freeze(state_dir: Path, episode_id: str, episodes: int) -> FrozenLayer:
    """End episode `episode_id` (its processes killed) and keep its files as a frozen layer,
    with room kept in the host for `episodes` new episodes on it. HostBusy, the episode
    untouched, when the host has no such room."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        connect_unix(sock, Path(state_dir) / "ctl.sock")
        sock.sendall(f"FREEZE {episode_id} {episodes}\n".encode())
        reply = _recv_line(sock)[0]
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        raise HostGone(f"no episode helper in {state_dir}: {e}") from e
    except OSError as e:
        sock.close()
        raise SandboxError(f"the episode helper did not answer: {e}") from e
    parts = reply.split()
    if len(parts) != 3 or parts[0] != "OK":
        sock.close()
        if reply == "ERR busy":
            raise HostBusy(f"the host in {state_dir} has no room for {episodes} episodes")
        raise SandboxError(f"the episode helper could not freeze episode {episode_id}: {reply or 'no answer'}")
    return FrozenLayer(parts[1], int(parts[2]), sock)


def quit_host(state_dir: Path) -> bool:
    """Ask the helper to end its host once no episode is live (it takes none meanwhile);
    True when it said it will (or was gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            connect_unix(sock, Path(state_dir) / "ctl.sock")
            sock.sendall(b"QUIT\n")
            return _recv_line(sock)[0] in ("BYE", "")
        except (FileNotFoundError, ConnectionRefusedError):
            return True
        except OSError:
            return False


class Process:
    """A process spawned in an episode: its connection reports its end."""

    def __init__(self, sock_path: str, argv: list[str], fds: list[int], *, user: str | None,
                 cwd: str | None = None, env: dict[str, str] | None = None, pty: tuple[int, int] | None = None):
        """`fds`: stdin, stdout, stderr; or none with `pty` (rows, cols): the helper makes a pty
        in the episode and hands its master back (`self.master`)."""
        items = [f"mode=pty\0rows={pty[0]}\0cols={pty[1]}" if pty else "mode=pipe", f"user={user or ''}"]
        items += [f"cwd={cwd}"] if cwd else []
        items += [f"env={k}={v}" for k, v in (env or {}).items()] + [f"arg={a}" for a in argv]
        payload = b"".join(i.encode() + b"\0" for i in items)
        self.returncode: tuple[int, int] | None = None  # (exit code or -1, signal or 0)
        self.master = -1
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(CONNECT_TIMEOUT_S)
        got: list[int] = []
        try:
            connect_unix(self.conn, sock_path)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            self.conn.sendmsg([struct.pack("I", len(payload))], rights)
            self.conn.sendall(payload)
            reply, rest = _recv_line(self.conn, got)
        except OSError as e:
            self.conn.close()
            raise SandboxError(f"could not start {argv[0]} in the episode: {e}") from e
        if not reply.startswith("PID "):
            self.conn.close()
            why = reply[4:] if reply.startswith("ERR ") else reply or "the episode is gone"
            if why.startswith("no such user"):
                raise AgentUserError(f"could not start {argv[0]} in the episode: {why}")
            raise SandboxError(f"could not start {argv[0]} in the episode: {why}")
        self.pid = int(reply[4:])  # in the episode's pid namespace
        self.master = got[0] if got else -1
        self.conn.setblocking(False)
        self._buf = rest  # its exit, when it came with the pid

    def fileno(self) -> int:
        return self.conn.fileno()

    def poll(self) -> tuple[int, int] | None:
        """(exit code, signal) once it has ended, else None."""
        if self.returncode is None and self.conn.fileno() >= 0 and b"\n" not in self._buf:
            try:
                chunk = self.conn.recv(256)
                self._buf += chunk
                if not chunk:
                    self.returncode = (-1, 9)  # the episode is gone, and the process with it
            except BlockingIOError:
                pass
            except OSError:
                self.returncode = (-1, 9)
        if self.returncode is None and b"\n" in self._buf:
            _, code, sig = self._buf.split(b"\n", 1)[0].decode().split()
            self.returncode = (int(code), int(sig))
        return self.returncode

    def wait(self, timeout: float | None) -> tuple[int, int] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            with selectors.DefaultSelector() as sel:
                sel.register(self.conn, selectors.EVENT_READ)
                sel.select(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
        return self.returncode

    def kill(self) -> None:
        """Hang up: the helper SIGKILLs the process's whole group."""
        self.conn.close()


class RemotePty(PtyProcess):
    """A process of an episode on a pty of the episode (its own devpts: `tty` names it there)
    whose master the helper hands back here. The foreground group and Ctrl-C work through the
    pty as for a local process (this host sees the episode's pids)."""

    def __init__(self, sock_path: str, argv: list[str], env: dict[str, str], user: str | None,
                 dimensions: tuple[int, int] = (50, 200), cwd: str | None = None):
        self.proc = Process(sock_path, argv, [], pty=dimensions, user=user, cwd=cwd, env=env)
        if self.proc.master < 0:
            self.proc.kill()
            raise SandboxError(f"the episode helper sent no terminal for {argv[0]}")
        self._init_reader(self.proc.master)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def isalive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.child_fd >= 0:
            os.close(self.child_fd)  # hangs up the terminal: its session leader gets SIGHUP
            self.child_fd = -1
        self.proc.wait(EXIT_GRACE_S)
        self.proc.kill()

    @property
    def exitstatus(self) -> int | None:
        rc = self.proc.returncode
        return rc[0] if rc is not None and rc[0] >= 0 else None

    @property
    def signalstatus(self) -> int | None:
        rc = self.proc.returncode
        return rc[1] if rc is not None and rc[1] > 0 else None


def _drain(fds: dict[int, bytearray], proc: Process, deadline: float | None) -> bool:
    """Read both pipes until they close (or, once the process ended, until they are quiet);
    False when the deadline came first."""
    sel = selectors.DefaultSelector()
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
    sel.register(proc, selectors.EVENT_READ)
    try:
        while len(sel.get_map()) > 1 or proc.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            quiet = 0.1 if proc.poll() is not None else None  # a background job keeps a pipe open
            wait = min(x for x in (left, quiet, 1.0) if x is not None)
            events = sel.select(wait)
            if not events and quiet is not None:
                return True
            for key, _ in events:
                if key.fileobj is proc:
                    if proc.poll() is not None:
                        sel.unregister(proc)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = fds[key.fd]
                buf += chunk
                if len(buf) > 2 * MAX_EXEC_CHARS:
                    del buf[: len(buf) - MAX_EXEC_CHARS]
        return True
    finally:
        sel.close()


def run_pipes(sock_path: str, argv: list[str], *, timeout: float | None, user: str | None, cwd: str | None,
              env: dict[str, str] | None) -> CommandResult:
    """One process in the episode, stdin empty, stdout and stderr captured apart; past
    `timeout` its process group is killed and the exit code is 124."""
    t0 = time.monotonic()
    rout, wout = os.pipe()
    rerr, werr = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        proc = Process(sock_path, argv, [null, wout, werr], user=user, cwd=cwd, env=env)
    except BaseException:
        for fd in (rout, rerr):
            os.close(fd)
        raise
    finally:
        for fd in (wout, werr, null):
            os.close(fd)
    bufs = {rout: bytearray(), rerr: bytearray()}
    try:
        finished = _drain(bufs, proc, None if timeout is None else t0 + timeout)
        code, sig = (proc.wait(None) or (-1, 9)) if finished else (-1, 9)
    finally:
        for fd in bufs:
            os.close(fd)
        proc.kill()  # past the timeout: the helper kills its process group
    out, err = (bytes(b[-MAX_EXEC_CHARS:]).decode("utf-8", errors="replace") for b in bufs.values())
    if not finished:
        return CommandResult(output=out, stderr=err, exit_code=124, timed_out=True, duration_s=time.monotonic() - t0)
    return CommandResult(output=out, stderr=err, exit_code=code if code >= 0 else 128 + sig,
                         duration_s=time.monotonic() - t0)


SpawnPty = Callable[[list[str], dict[str, str]], PtyProcess]
