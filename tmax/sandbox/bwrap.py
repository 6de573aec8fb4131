"""bubblewrap jail: the host's filesystem read-only, a writable workspace, a private
/tmp, no network unless asked, its own pid namespace, and it dies with tmax.

The root is a tmpfs holding read-only binds of every top-level host directory, so a
workspace can appear at a new top-level path (e.g. /workspace) that does not exist on
the host; the root is remounted read-only afterwards. /tmp and $HOME are host temp
directories bound in, so the agent's shell and one-off `exec` processes (separate bwrap
instances, e.g. a verifier) see the same files.

No `--new-session`: it would detach bash from its terminal and break job control and
Ctrl-C. Its purpose (blocking TIOCSTI injection into the caller's terminal) does not
apply, because the terminal here is a pty created for this sandbox alone.

A fork is a jail of the same spec whose workspace, /tmp and $HOME are copies of the parent's
(the workspace at the parent's path inside, even where the parent's is a host directory of the
user's: the child's writes stay in its copy).
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import tempfile
from dataclasses import replace
from pathlib import Path

from tmax.sandbox.base import NAME_PREFIX, CommandResult, Forked, SandboxCapabilities, SandboxError, SandboxSpec
from tmax.sandbox.fork import copy_tree
from tmax.sandbox.hostexec import run_process
from tmax.sandbox.local import copy_path
from tmax.sandbox.shell import BASH_ARGV, PersistentShell
from tmax.sandbox.shell_sandbox import ShellSandbox

DEFAULT_TARGET = "/workspace"
# Credentials the host filesystem would show the agent (whatever a command prints goes to
# the model provider): masked with an empty file or directory unless exposed on purpose.
CREDENTIAL_PATHS = (
    "~/.ssh", "~/.gnupg", "~/.aws", "~/.azure", "~/.kube", "~/.netrc", "~/.git-credentials",
    "~/.docker/config.json", "~/.config/gcloud", "~/.config/gh", "~/.config/tmax", "~/.pypirc",
    "~/.npmrc", "~/.cargo/credentials.toml", "~/.config/containers/auth.json",
    "/etc/shadow", "/etc/gshadow", "/run/containers/0/auth.json",
)
SKIP_TOP = {"proc", "dev", "tmp"}
MASK_SCAN_FILES = 2000  # files per masked directory checked for hard links (credential dirs are small)
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def available() -> bool:
    return shutil.which("bwrap") is not None


class BwrapSandbox(ShellSandbox):
    kind = "bwrap"
    capabilities = SandboxCapabilities(fork=True, snapshot="jail", network=True, workspace_target=True)

    def __init__(self, spec: SandboxSpec | None = None, fork_of: BwrapSandbox | None = None):
        """`fork_of`: the started jail whose writable directories this one starts with copies of."""
        self.spec = spec or SandboxSpec()
        self.fork_of = fork_of
        self.shell: PersistentShell | None = None
        self._own_dir: str | None = None  # host temp dir holding /tmp, $HOME (and a workspace)
        self.workspace: Path | None = None
        self.target = ""
        self.tmp_host: Path | None = None
        self.home_host: Path | None = None
        self._mask_args: list[str] | None = None

    # -- construction ---------------------------------------------------------------

    def _prepare(self) -> None:
        if not available():
            raise SandboxError("bwrap sandbox: bubblewrap is not installed (apt-get install bubblewrap)")
        self._own_dir = tempfile.mkdtemp(prefix=NAME_PREFIX + "bwrap-")
        own = Path(self._own_dir)
        self.tmp_host, self.home_host = own / "tmp", own / "home"
        self.tmp_host.mkdir()
        self.home_host.mkdir()
        os.chmod(self.tmp_host, 0o1777)
        if self.spec.workspace is not None:
            self.workspace = Path(self.spec.workspace).resolve()
            if not self.workspace.is_dir():
                raise SandboxError(f"bwrap sandbox: workspace {self.workspace} is not a directory")
            self.target = self.spec.workspace_target or str(self.workspace)
        else:
            self.workspace = own / "workspace"
            self.workspace.mkdir()
            self.target = self.spec.workspace_target or DEFAULT_TARGET
        t = Path(self.target)
        if not t.is_absolute():
            raise SandboxError(f"bwrap sandbox: workspace target {self.target} must be absolute")
        # Read-only binds cannot gain new mount points below them.
        if len(t.parts) > 2 and not t.exists():
            raise SandboxError(f"bwrap sandbox: workspace target {self.target} must exist on the host"
                               " or be a new top-level directory")
        if self.fork_of is not None:
            for (_, parent), (_, mine) in zip(self.fork_of.writable_dirs(), self.writable_dirs(), strict=True):
                copy_tree(parent, mine)
            self.fork_of = None  # nothing more is read of the parent

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": BASE_PATH, "HOME": "/root-home", "LANG": os.environ.get("LANG", "C.UTF-8"),
               "TERM": "dumb", "TMPDIR": "/tmp"}
        env.update(self.spec.env)
        env.update(extra or {})
        return env

    def bwrap_argv(self, env: dict[str, str], chdir: str) -> list[str]:
        """The bwrap prefix; the command to run follows it."""
        assert self.tmp_host and self.home_host and self.workspace
        a = ["bwrap", "--tmpfs", "/"]
        for name in sorted(os.listdir("/")):
            if name in SKIP_TOP:
                continue
            p = "/" + name
            if os.path.islink(p):
                a += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p) or os.path.isfile(p):
                a += ["--ro-bind", p, p]
        a += ["--dev", "/dev", "--proc", "/proc", "--bind", str(self.tmp_host), "/tmp",
              "--dir", "/root-home", "--bind", str(self.home_host), "/root-home"]
        for host, target, ro in self.spec.mounts:
            a += ["--ro-bind" if ro else "--bind", host, target]
        if not Path(self.target).exists():
            a += ["--dir", self.target]
        a += ["--bind", str(self.workspace), self.target]
        a += self.mask_args()
        a += ["--remount-ro", "/"]
        a += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "tmax-bwrap",
              "--die-with-parent"]
        if not self.spec.network:
            a.append("--unshare-net")
        if os.geteuid() == 0:
            # Root with capabilities could remount the host read-write.
            a += ["--cap-drop", "ALL"]
        a.append("--clearenv")  # the host's environment (API keys) stays outside
        for k, v in env.items():
            a += ["--setenv", k, v]
        a += ["--chdir", chdir]
        return a

    def masked_paths(self) -> list[Path]:
        """The host paths to hide: credential paths and `spec.masked`, less what is exposed,
        what the jail cannot see anyway and what lies inside another masked directory (a
        mount below a read-only tmpfs cannot be made: bwrap would fail with exit 7)."""
        exposed = [Path(os.path.realpath(os.path.expanduser(p))) for p in self.spec.exposed]
        paths: list[Path] = []
        for raw in (*CREDENTIAL_PATHS, *self.spec.masked):
            path = Path(os.path.realpath(os.path.expanduser(raw)))
            shown = any(path == e or e in path.parents for e in exposed)
            # The jail has its own /tmp, /proc and /dev: host files there are out of sight.
            in_jail = path.parts[1:2] and path.parts[1] not in SKIP_TOP or self.workspace in path.parents
            # Masking the workspace or a directory holding it would hide the work itself.
            holds_workspace = self.workspace is not None and (path == self.workspace or path in self.workspace.parents)
            if shown or not in_jail or holds_workspace or not path.exists() or path in paths:
                continue
            paths.append(path)
        dirs = [p for p in paths if p.is_dir()]
        return [p for p in paths if not any(d in p.parents for d in dirs)]

    def jail_argv(self, env: dict[str, str], chdir: str, command: list[str]) -> list[str]:
        """`command` in the jail, with bwrap's own arguments read from a file (`--args`):
        the jail's pid 1 is bwrap, and its /proc/1/cmdline would otherwise show the host's
        paths, the masked credential files and the environment to whatever runs inside."""
        assert self._own_dir is not None
        fd, path = tempfile.mkstemp(prefix="args-", dir=self._own_dir)
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(a.encode() + b"\0" for a in self.bwrap_argv(env, chdir)[1:]))
        return ["sh", "-c", 'f=$1; shift; exec bwrap --args 3 "$@" 3<"$f"', "tmax-bwrap", path, *command]

    def refuse_linked_masks(self, paths: list[Path]) -> None:
        """A hard link to a masked file, made in the workspace, would show its contents: masks
        go by path, links share the inode. Refuse to start while a masked file has a second
        link on the workspace's filesystem (finding the link itself would mean walking the
        whole workspace)."""
        assert self.workspace is not None
        device = self.workspace.stat().st_dev
        for path in paths:
            files = [path] if not path.is_dir() else (Path(d) / f for d, _, names in os.walk(path) for f in names)
            for n, f in enumerate(files):
                if n >= MASK_SCAN_FILES:
                    break
                try:
                    st = f.lstat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and st.st_dev == device:
                    raise SandboxError(
                        f"bwrap sandbox: {f} is masked in the jail but has {st.st_nlink} hard links on the workspace's "
                        f"filesystem; a link inside {self.workspace} would show its contents. Remove the extra link "
                        f"(find {shlex.quote(str(self.workspace))} -samefile {shlex.quote(str(f))}) or --expose {path}")

    def mask_args(self) -> list[str]:
        """Cover each masked path: a directory with an empty read-only tmpfs, a file with an
        empty read-only file."""
        assert self._own_dir is not None
        empty = Path(self._own_dir) / "masked"
        empty.touch(mode=0o444)
        args: list[str] = []
        paths = self.masked_paths()
        self.refuse_linked_masks(paths)
        for path in paths:
            if path.is_dir():
                args += ["--tmpfs", str(path), "--remount-ro", str(path)]
            else:
                args += ["--ro-bind", str(empty), str(path)]
        self._mask_args = args
        return args

    # -- Sandbox ----------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._prepare()
            chdir = self.spec.workdir or self.target
            self.shell = PersistentShell(BASH_ARGV, workdir=chdir, spawn_env={})
            self.shell.setup_in_env = True
            self.shell.after_start = self._after_start()
            self._shell_argv(self.handover)
            self.shell.start()
        except SandboxError:
            self.close()
            raise

    def fork(self) -> Forked:
        t0, state, background = self._fork_state()
        child = BwrapSandbox(replace(self.spec, workspace=None, workspace_target=self.target), fork_of=self)
        child._handing_over(state)
        child.start()  # closes itself if it fails
        return self._forked(child, state, background, t0)

    def _shell_argv(self, extra: dict[str, str]) -> None:
        """The jail the shell starts (and restarts) in: its setup, and `extra`, in its environment."""
        shell = self._shell()
        shell.argv = self.jail_argv(self._env({**shell.setup_vars(), **extra}), shell.workdir or self.target, BASH_ARGV)

    def _restored(self, state) -> str:
        said = super()._restored(state)
        self._shell_argv({})  # a restart's jail starts without the fork's state in its environment
        return said

    def exec(self, argv: list[str], timeout: float | None = None, workdir: str | None = None,
             env: dict[str, str] | None = None, user: str | None = None) -> CommandResult:
        # `user` is ignored: a host sandbox runs as the invoking user.
        self._shell()
        full = self.jail_argv(self._env(env), workdir or self.spec.workdir or self.target, list(argv))
        try:
            return run_process(full, timeout, env={})
        finally:
            Path(full[4]).unlink(missing_ok=True)  # the arguments file: read once at the start

    def writable_dirs(self) -> list[tuple[str, Path]]:
        """(path inside, host directory) of every place the jail can write."""
        assert self.workspace and self.tmp_host and self.home_host, "the sandbox is not started"
        return [(self.target, self.workspace), ("/tmp", self.tmp_host), ("/root-home", self.home_host)]

    def host_path(self, inside: str) -> Path:
        """Where a writable path inside the jail lives on the host."""
        p = Path(os.path.normpath(inside if os.path.isabs(inside) else os.path.join(self.target, inside)))
        for root, host in self.writable_dirs():
            if p == Path(root) or Path(root) in p.parents:
                return host / p.relative_to(root)
        raise SandboxError(f"bwrap sandbox: {inside} is not under the workspace ({self.target}) or /tmp;"
                           " the rest of the filesystem is read-only")

    def copy_in(self, src: Path, dst: str) -> None:
        self._shell()
        copy_path(Path(src), self.host_path(dst))

    def copy_out(self, src: str, dst: Path) -> None:
        self._shell()
        inside = Path(os.path.normpath(src if os.path.isabs(src) else os.path.join(self.target, src)))
        try:
            host = self.host_path(str(inside))
        except SandboxError:
            host = inside  # read-only parts are the host's own files
        copy_path(host, Path(dst))

    def close(self) -> None:
        self._close_shell()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
        self._mask_args = None
