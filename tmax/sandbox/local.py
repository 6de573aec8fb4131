"""No isolation: the persistent shell runs on the host, in the given workdir.

For `tmax run --sandbox local`, where a person watches (and by default confirms) each
command. Paths inside are host paths. A fork works in a copy of the workdir (its cwd moved
along when it was inside); the rest of the host is shared, as everything is here."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from tmax.sandbox.base import NAME_PREFIX, CommandResult, Forked, SandboxCapabilities, SandboxError, SandboxSpec
from tmax.sandbox.fork import copy_tree
from tmax.sandbox.hostexec import run_process
from tmax.sandbox.shell import BASH_ARGV, PersistentShell
from tmax.sandbox.shell_sandbox import ShellSandbox


def copy_path(src: Path, dst: Path) -> None:
    """Copy a file or a directory tree to exactly `dst`, creating parents."""
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise SandboxError(f"copy: {src} does not exist")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)


class LocalSandbox(ShellSandbox):
    kind = "local"
    capabilities = SandboxCapabilities(fork=True, snapshot="workdir")

    def __init__(self, spec: SandboxSpec | None = None, owned_dir: Path | None = None):
        """`owned_dir`: a directory this sandbox removes at its close (a fork's copy)."""
        self.spec = spec or SandboxSpec()
        root = self.spec.workdir or (str(self.spec.workspace) if self.spec.workspace else os.getcwd())
        self.workdir = str(Path(root).resolve())
        self.shell: PersistentShell | None = None
        self.owned_dir = owned_dir

    def start(self) -> None:
        if not Path(self.workdir).is_dir():
            raise SandboxError(f"local sandbox: workdir {self.workdir} is not a directory")
        self.shell = PersistentShell(BASH_ARGV, env=self.spec.env, workdir=self.workdir,
                                     spawn_cwd=self.workdir)
        self.shell.start_vars = self.handover
        self.shell.after_start = self._after_start()
        self.shell.setup_in_env = True
        self.shell.start()

    def exec(self, argv: list[str], timeout: float | None = None, workdir: str | None = None,
             env: dict[str, str] | None = None, user: str | None = None) -> CommandResult:
        # `user` is ignored: a host sandbox runs as the invoking user.
        full_env = {**os.environ, **self.spec.env, **(env or {})}  # later sources win on repeated keys
        return run_process(argv, timeout, cwd=workdir or self.workdir, env=full_env)

    def copy_in(self, src: Path, dst: str) -> None:
        copy_path(Path(src), Path(dst) if os.path.isabs(dst) else Path(self.workdir) / dst)

    def copy_out(self, src: str, dst: Path) -> None:
        copy_path(Path(src) if os.path.isabs(src) else Path(self.workdir) / src, Path(dst))

    def fork(self) -> Forked:
        t0, state, background = self._fork_state()
        copy = Path(tempfile.mkdtemp(prefix=NAME_PREFIX + "fork-"))
        try:
            copy_tree(Path(self.workdir), copy)
            state = state.moved(self.workdir, str(copy))
            child = LocalSandbox(replace(self.spec, workdir=str(copy), workspace=None), owned_dir=copy)
            child._handing_over(state)
            child.start()
        except BaseException:
            shutil.rmtree(copy, ignore_errors=True)
            raise
        return self._forked(child, state, background, t0)

    def _process_root(self) -> int | None:
        return self._shell().inner_pid  # bash itself (its spawner may exec it, or not)

    def close(self) -> None:
        self._close_shell()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
            self.owned_dir = None
