"""Files in and out of an overlay episode, through the fd of its root.

Every path is resolved with `openat2(RESOLVE_IN_ROOT)`: as the episode would resolve it
(`/` and `..` stop at its root, symlinks stay inside), and each created name is one
component under a directory opened that way, so nothing written follows a link out.

A file or directory written here is what a tar copy into a container makes of it (podman's
`copy_in`, a COPY of `podman build`): a new entry owned by the writer (root inside), with
the source's mode and its mtime to the nearest second; a directory that exists keeps its entries
and takes the source's mode and mtime. The files layer of an episode (`base.FilesLayer`)
is written the same way (`write_layer`).
"""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

from tmax.sandbox.base import FilesLayer, LayerCopy, LayerDir, SandboxError

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FilesLayerError(SandboxError):
    """A files layer could not be written into an episode (a COPY onto a path of the base
    image that cannot take it): that task's episodes need its built image."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """`path` opened as the episode sees it: `/` and `..` stop at its root, symlinks resolve in it."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root_fd), os.fsencode(path or "/"),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _dir_at(root_fd: int, path: str, create: bool) -> int:
    """An fd of directory `path` inside, its missing parents created (mkdir -p, mode 755
    whatever this process's umask) when asked."""
    try:
        return open_in_root(root_fd, path, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        if not create or path in ("", "/"):
            raise
    parent, name = os.path.split(path.rstrip("/"))
    pfd = _dir_at(root_fd, parent, True)
    try:
        try:
            os.mkdir(name, 0o755, dir_fd=pfd)
            os.chmod(name, 0o755, dir_fd=pfd, follow_symlinks=False)
        except FileExistsError:
            pass
        return os.open(name, _DIR_FLAGS, dir_fd=pfd)
    finally:
        os.close(pfd)


def _is_dir_inside(root_fd: int, path: str) -> bool:
    try:
        os.close(open_in_root(root_fd, path, os.O_PATH | os.O_DIRECTORY))
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def _mtime_ns(st: os.stat_result) -> tuple[int, int]:
    """(atime, mtime) as podman's tar copy sets them: the source's mtime rounded to the
    nearest whole second (a tar header's), both."""
    ns = (st.st_mtime_ns + 500_000_000) // 1_000_000_000 * 1_000_000_000
    return ns, ns


def _put(src: Path, name: str, dir_fd: int) -> None:
    """`src` (file, directory or symlink) as `name` in the directory `dir_fd`; nothing it
    replaces is followed."""
    st = src.lstat()
    if stat.S_ISLNK(st.st_mode):
        _unlink_at(name, dir_fd)
        os.symlink(os.readlink(src), name, dir_fd=dir_fd)
    elif stat.S_ISDIR(st.st_mode):
        _put_dir(src, st, name, dir_fd)
    elif stat.S_ISREG(st.st_mode):
        _unlink_at(name, dir_fd)  # a new file, as a tar copy makes: not the old one's owner or links
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        with open(fd, "wb") as out, open(src, "rb") as inp:
            while chunk := inp.read(1 << 20):
                out.write(chunk)
            out.flush()
            os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode))
            os.utime(out.fileno(), ns=_mtime_ns(st))


def _put_dir(src: Path, st: os.stat_result, name: str, dir_fd: int) -> None:
    """A directory and its entries: one that exists keeps its own; the mode (made 700 while
    it is filled: a read-only source's children must still go in) and the mtime come last."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            _unlink_at(name, dir_fd)
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        for child in sorted(src.iterdir()):
            _put(child, child.name, sub)
    finally:
        os.close(sub)
    os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dir_fd, follow_symlinks=False)
    os.utime(name, ns=_mtime_ns(st), dir_fd=dir_fd, follow_symlinks=False)


def _unlink_at(name: str, dir_fd: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            for entry in os.scandir(sub):
                _unlink_at(entry.name, sub)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def copy_in(root_fd: int, src: Path, dst: str) -> None:
    """Host `src` (file or directory) so that it becomes exactly `dst` inside."""
    parent, name = os.path.split(dst.rstrip("/") or "/")
    if not name:
        raise SandboxError(f"copy_in: cannot replace {dst}")
    try:
        pfd = _dir_at(root_fd, parent, create=True)
        try:
            _put(Path(src), name, pfd)
        finally:
            os.close(pfd)
    except OSError as e:
        raise SandboxError(f"copy_in {src} -> {dst}: {e}") from e


def write_layer(root_fd: int, layer: FilesLayer) -> None:
    """A files layer's steps, in order, in the episode's root (`base.FilesLayer`);
    FilesLayerError when one cannot be written."""
    step: LayerCopy | LayerDir | None = None
    try:
        for step in layer.steps:
            if isinstance(step, LayerDir):
                os.close(_dir_at(root_fd, step.path, create=True))
            else:
                _copy_step(root_fd, step)
    except OSError as e:
        raise FilesLayerError(f"files layer: {step}: {e}") from e


def _copy_step(root_fd: int, step: LayerCopy) -> None:
    """One COPY: a directory's contents into `dest` (made if missing); a file into `dest`
    when that is a directory (or `into`), else as `dest`."""
    for src in map(Path, step.sources):
        if stat.S_ISDIR(src.lstat().st_mode):
            dfd = _dir_at(root_fd, step.dest, create=True)
            try:
                for child in sorted(src.iterdir()):
                    _put(child, child.name, dfd)
            finally:
                os.close(dfd)
            continue
        if step.into or _is_dir_inside(root_fd, step.dest):
            parent, name = step.dest, src.name
        else:
            parent, name = os.path.split(step.dest)
        pfd = _dir_at(root_fd, parent, create=True)
        try:
            _put(src, name, pfd)
        finally:
            os.close(pfd)


def _get(fd: int, dst: Path) -> None:
    """What `fd` (an O_PATH fd of an entry inside) is, copied to `dst` on the host."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        dst.mkdir(parents=True, exist_ok=True)
        dirfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            for entry in os.scandir(dirfd):
                if entry.is_symlink():
                    target = dst / entry.name
                    target.unlink(missing_ok=True)
                    os.symlink(os.readlink(entry.name, dir_fd=dirfd), target)
                    continue
                sub = os.open(entry.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
                try:
                    _get(sub, dst / entry.name)
                finally:
                    os.close(sub)
        finally:
            os.close(dirfd)
    elif stat.S_ISREG(st.st_mode):
        rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)  # reopens this very file
        with open(rfd, "rb") as inp, open(dst, "wb") as out:
            while chunk := inp.read(1 << 20):
                out.write(chunk)
        os.chmod(dst, stat.S_IMODE(st.st_mode))


def copy_out(root_fd: int, src: str, dst: Path) -> None:
    """`src` inside (file or directory) to exactly `dst` on the host (a directory into an
    existing one merges). Devices, fifos and sockets are left out."""
    try:
        fd = open_in_root(root_fd, src, os.O_PATH)
    except OSError as e:
        raise SandboxError(f"copy_out: {src} not found in the episode: {e}") from e
    try:
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        _get(fd, Path(dst))
    except OSError as e:
        raise SandboxError(f"copy_out {src} -> {dst}: {e}") from e
    finally:
        os.close(fd)
