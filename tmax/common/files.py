"""Files that readers never see half-written, JSON read without raising, and TOML config
files read with a clear error.

Every results file of tmax is written to a temporary name in its directory and renamed over
the old one, so a crash or a kill leaves the old content or the new, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def cache_dir() -> Path:
    """tmax's cache (`$TMAX_CACHE_DIR`, else ~/.cache/tmax): built images' records, helpers."""
    env = os.environ.get("TMAX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tmax"


def write_json_atomic(path: Path, obj: Any, indent: int | None = 2) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one
    (every results file of tmax is written this way)."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=str, ensure_ascii=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a reader
    (or a later step that trusts the file) sees the old content or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_dir_atomic(dest: Path, make: Callable[[Path], T]) -> T:
    """`make` a directory beside `dest` (it is handed the path, which does not exist yet),
    then rename it to `dest`, replacing what was there: a reader, or a later run that trusts
    the directory, never sees half of one. Returns what `make` returned."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = make(tmp)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return result


def read_json(path: Path) -> Any:
    """The JSON in `path`, or None where the file is missing or does not parse: for files
    another process may not have written yet (a trial still running, a job started elsewhere)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_toml(path: Path) -> dict[str, Any]:
    """A config file's TOML; ConfigError, naming the file, where it is missing, unreadable or
    not TOML."""
    import tomllib

    from tmax.common.errors import ConfigError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from None


def trim_jsonl(path: Path, keep: Callable[[Any], bool] | None = None) -> int:
    """Rewrite a JSONL record atomically with only its complete lines (and of those, the ones
    `keep(record)` accepts); returns how many lines were dropped. A missing file is left be."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if keep is None or keep(record):
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def append_line_atomic(path: Path, line: str) -> None:
    """Append `line` and a newline to `path` as one write under an exclusive lock, then fsync:
    writers side by side never interleave, and a reader sees the whole line or none of it. A
    last line an earlier crash cut short (no newline at the end) is ended first, so it spoils
    only itself."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        data = (("\n" if torn else "") + line.rstrip("\n") + "\n").encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock
