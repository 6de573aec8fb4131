"""Waiting until something is ready, and retrying what failed: the one place tmax polls
or backs off (tenacity), for services coming up, containers going away and model calls."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from tenacity import (
    RetryCallState, Retrying, retry_if_exception_type, retry_if_result, stop_after_attempt, stop_before_delay,
    wait_exponential, wait_fixed,
)

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout_s: float, interval_s: float = 1.0,
               max_interval_s: float | None = None) -> T:
    """Call `check` every `interval_s` seconds (growing by half each time up to
    `max_interval_s`, when given) until it returns something truthy, which is returned, or
    `timeout_s` has passed, when its last (falsy) answer is returned. An exception from
    `check` ends the wait at once: a check raises to give up early."""
    wait = (wait_exponential(multiplier=interval_s, exp_base=1.5, min=interval_s, max=max_interval_s)
            if max_interval_s else wait_fixed(interval_s))
    retrying = Retrying(stop=stop_before_delay(timeout_s), wait=wait,
                        retry=retry_if_result(lambda answer: not answer),
                        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None)
    return retrying(check)


def retry_call(call: Callable[[], T], *, attempts: int, backoff_s: Sequence[float], retry_on: type[BaseException],
               on_retry: Callable[[int, BaseException, float], None] | None = None,
               sleep: Callable[[float], None] = time.sleep) -> T:
    """`call()`, tried up to `attempts` times while it raises `retry_on`; before try n + 1
    it waits `backoff_s[n - 1]` (the last entry for later tries, 0 when empty) after
    telling `on_retry(n, error, delay)`. The last error is raised as it is."""

    def delay(state: RetryCallState) -> float:
        n = state.attempt_number
        return float(backoff_s[min(n - 1, len(backoff_s) - 1)]) if backoff_s else 0.0

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            on_retry(state.attempt_number, state.outcome.exception(), delay(state))

    retrying = Retrying(stop=stop_after_attempt(max(1, attempts)), wait=delay, retry=retry_if_exception_type(retry_on),
                        before_sleep=before_sleep, sleep=sleep, reraise=True)
    return retrying(call)
