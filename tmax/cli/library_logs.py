"""What the libraries under `tmax learn` write to the process's stderr goes to a log file
in the run directory, not to the user's output.

Ray's core worker in the driver writes its C++ log lines (warnings and errors about its
own bookkeeping, e.g. actor constructor arguments held in the object store) straight to
file descriptor 2, and Python handlers the libraries set up at import hold the stream on
that descriptor too. `library_logs` points descriptor 2 at `RUN_DIR/logs/driver.log` for
the run and gives Python's `sys.stderr` a stream on the original descriptor, so what tmax
itself prints (the lines per step, notes, errors) still reaches the user. Ray's worker
processes and the vLLM servers log to their own files already (Ray's session directory;
`rl/engine/vllm.log`). Hugging Face progress bars (weights loaded or written) are off,
and Python warnings (a library's deprecation notes) and log records no handler takes
(which Python would print to stderr) go to the log too."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DRIVER_LOG = Path("logs") / "driver.log"


def _on_fd2(stream: object) -> bool:
    try:
        return stream.fileno() == 2  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False  # a captured stream (a test runner's): left as it is


@contextmanager
def library_logs(run_dir: Path) -> Iterator[Path]:
    """Inside: descriptor 2 writes to `run_dir/logs/driver.log` (returned); `sys.stderr`,
    where it was descriptor 2, a stream on the original one."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    log = run_dir / DRIVER_LOG
    made = [d for d in (log.parent, *log.parent.parents) if not d.exists()]  # removed again if left empty
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("ab") as f:
        os.dup2(f.fileno(), 2)
    swap = _on_fd2(sys.stderr)
    before, show = sys.stderr, warnings.showwarning
    to_log = logging.StreamHandler(before)  # `before` writes to descriptor 2: the log
    if swap:
        sys.stderr = open(saved, "w", buffering=1, encoding=before.encoding, errors="backslashreplace", closefd=False)
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: show(
            message, category, filename, lineno, before, line)
        logging.root.addHandler(to_log)
    try:
        yield log
    finally:
        sys.stderr.flush()
        warnings.showwarning = show
        logging.root.removeHandler(to_log)
        if swap:
            before.flush()  # what a library left buffered belongs to the log
            sys.stderr.close()  # closefd=False: `saved` stays open until restored
            sys.stderr = before
        os.dup2(saved, 2)
        os.close(saved)
        _remove_if_empty(log, made)


def _remove_if_empty(log: Path, made: list[Path]) -> None:
    """A run that stopped before any library wrote (bad input, a missing extra) leaves nothing."""
    if log.stat().st_size:
        return
    log.unlink()
    for d in made:  # innermost first
        try:
            d.rmdir()
        except OSError:
            return  # the run wrote there


def log_tail(log: Path, lines: int = 20) -> list[str]:
    """The last `lines` non-empty lines of a log ([] when there is none)."""
    if not log.is_file():
        return []
    return [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-lines:]
