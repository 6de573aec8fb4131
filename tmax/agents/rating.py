"""A session's reward, stored next to its records (`reward.json`) so a trainer can use it.

`tmax run` writes it from `/good` (1.0), `/bad` (0.0) or `--verify CMD` (1.0 when CMD
exits 0, else 0.0); `training.runs_data` reads it back.
"""

from __future__ import annotations

from pathlib import Path

from tmax.common.records import Rating, RatingSource, RecordError, SessionDir, read_record, write_record
from tmax.sandbox.base import Sandbox


def write_reward(run_dir: str | Path, reward: float, source: RatingSource, *, command: str | None = None,
                 exit_code: int | None = None, output: str | None = None) -> Rating:
    """Record (or replace) the session's reward; `source` says who gave it."""
    record = Rating(reward=float(reward), source=source, command=command, exit_code=exit_code, output=output)
    write_record(SessionDir(Path(run_dir)).reward, record)
    return record


def read_reward(run_dir: str | Path) -> float | None:
    """The stored reward, or None when the session was never rated."""
    path = SessionDir(Path(run_dir)).reward
    if not path.is_file():
        return None
    try:
        return read_record(path, Rating).reward
    except RecordError as e:
        raise ValueError(f"{e} (the reward must be a number)") from None


RATINGS = {"/good": 1.0, "/bad": 0.0}
VERIFY_TIMEOUT_S = 600.0


def rate(run_dir: str | Path, word: str) -> str:
    """`/good` or `/bad`: store the reward; returns the line to show."""
    reward = RATINGS[word]
    write_reward(run_dir, reward, RatingSource.USER)
    return f"Session rated {word[1:]} (reward {reward:g}), saved in {SessionDir(Path(run_dir)).reward}."


def verify(box: Sandbox, command: str, run_dir: str | Path, timeout: float = VERIFY_TIMEOUT_S) -> Rating:
    """Run `command` in the sandbox (outside the agent's shell); exit status 0 is reward 1."""
    result = box.exec(["bash", "-c", command], timeout=timeout)
    reward = 1.0 if result.exit_code == 0 else 0.0
    return write_reward(run_dir, reward, RatingSource.VERIFY, command=command, exit_code=result.exit_code,
                        output=(result.output + result.stderr)[-2000:])
