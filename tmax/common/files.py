"""Files that readers never see half-written, and JSON read without raising.

Every results file of tmax is written to a temporary name in its directory and renamed over
the old one, so a crash or a kill leaves the old content or the new, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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


def read_json(path: Path) -> Any:
    """The JSON in `path`, or None where the file is missing or does not parse: for files
    another process may not have written yet (a trial still running, a job started elsewhere)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
