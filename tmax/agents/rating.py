"""A session's reward, stored next to its records (`reward.json`) so a trainer can use it.

`tmax run` writes it from `/good` (1.0), `/bad` (0.0) or `--verify CMD` (1.0 when CMD
exits 0, else 0.0); `training.runs_data` reads it back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tmax.common.files import write_json_atomic

REWARD = "reward.json"


def write_reward(run_dir: str | Path, reward: float, source: str, **detail: Any) -> dict[str, Any]:
    """Record (or replace) the session's reward; `source` says who gave it (user | verify)."""
    record = {"reward": float(reward), "source": source, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **detail}
    write_json_atomic(Path(run_dir) / REWARD, record)
    return record


def read_reward(run_dir: str | Path) -> float | None:
    """The stored reward, or None when the session was never rated."""
    path = Path(run_dir) / REWARD
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["reward"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a reward record: {e}") from None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{path}: reward must be a number, got {value!r}")
    return float(value)


RATINGS = {"/good": 1.0, "/bad": 0.0}
VERIFY_TIMEOUT_S = 600.0


def rate(run_dir: str | Path, word: str) -> str:
    """`/good` or `/bad`: store the reward; returns the line to show."""
    reward = RATINGS[word]
    write_reward(run_dir, reward, "user")
    return f"Session rated {word[1:]} (reward {reward:g}), saved in {Path(run_dir) / REWARD}."


def verify(box: Any, command: str, run_dir: str | Path, timeout: float = VERIFY_TIMEOUT_S) -> dict[str, Any]:
    """Run `command` in the sandbox (outside the agent's shell); exit status 0 is reward 1."""
    result = box.exec(["bash", "-c", command], timeout=timeout)
    reward = 1.0 if result.exit_code == 0 else 0.0
    return write_reward(run_dir, reward, "verify", command=command, exit_code=result.exit_code,
                        output=(result.output + result.stderr)[-2000:])
