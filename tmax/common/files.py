"""Files that readers never see half-written, and JSON read without raising.

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
