"""A pool of sandboxes for concurrent trials and rollouts.

Every acquire hands out a fresh sandbox (state never leaks from one trial to the next);
`size` bounds how many exist at once, and `warm` keeps that many started ahead of time
so a trial does not wait for a container to start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sandbox import make_sandbox
from sandbox.base import Sandbox, SandboxError, SandboxSpec


class SandboxPool:
    def __init__(self, kind: str, spec: SandboxSpec | None = None, size: int = 4, warm: int = 0,
                 factory: Callable[[], Sandbox] | None = None, **options):
        if size < 1:
            raise ValueError("pool size must be at least 1")
        if not 0 <= warm <= size:
            raise ValueError("warm must be between 0 and the pool size")
        self.size = size
        self.warm = warm
        self._factory = factory or (lambda: make_sandbox(kind, spec, **options))
        self._cond = threading.Condition()
        self._idle: list[Sandbox] = []
        self._in_use: set[int] = set()
        self._total = 0  # in use + idle + being started; never above size
        self._closed = False
        self._warmers: list[threading.Thread] = []
        with self._cond:
            for _ in range(warm):
                self._warm_one_locked()

    def _new(self) -> Sandbox:
        sb = self._factory()
        try:
            sb.start()
        except BaseException:
            sb.close()
            raise
        return sb

    def _warm_one_locked(self) -> None:
        if self._closed or self._total >= self.size:
            return
        self._total += 1

        def work() -> None:
            try:
                sb = self._new()
            except Exception:
                with self._cond:
                    self._total -= 1
                    self._cond.notify_all()
                return
            with self._cond:
                if self._closed:
                    self._total -= 1
                else:
                    self._idle.append(sb)
                    sb = None
                self._cond.notify_all()
            if sb is not None:
                sb.close()

        t = threading.Thread(target=work, daemon=True)
        self._warmers.append(t)
        t.start()

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A started sandbox for one trial; blocks while `size` exist."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxError("sandbox pool is closed")
                if self._idle:
                    sb = self._idle.pop()
                    self._in_use.add(id(sb))
                    return sb
                if self._total < self.size:
                    self._total += 1
                    break
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise SandboxError(f"no free sandbox after {timeout} s (pool size {self.size})")
                self._cond.wait(wait)
        try:
            sb = self._new()
        except BaseException:
            with self._cond:
                self._total -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._in_use.add(id(sb))
        return sb

    def release(self, sb: Sandbox) -> None:
        """Destroy a sandbox handed out by `acquire` and free its slot."""
        with self._cond:
            if id(sb) not in self._in_use:
                return
            self._in_use.discard(id(sb))
        try:
            sb.close()
        finally:
            with self._cond:
                self._total -= 1
                if len(self._idle) < self.warm:
                    self._warm_one_locked()
                self._cond.notify_all()

    @contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    def close(self) -> None:
        """Destroy the idle sandboxes; ones still in use are closed by their release."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._warmers:
            t.join(timeout=120)
        with self._cond:
            idle, self._idle = self._idle, []
            self._total -= len(idle)
        for sb in idle:
            sb.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
