"""A pool of sandboxes for concurrent trials and rollouts.

Every acquire hands out a fresh sandbox (state never leaks from one trial to the next);
`size` bounds how many exist at once, and `warm` keeps that many started ahead of time
so a trial does not wait for a container to start.
"""

from __future__ import annotations

import threading
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
        self._slots = threading.BoundedSemaphore(size)  # sandboxes in use + warm ones
        self._lock = threading.Lock()
        self._idle: list[Sandbox] = []
        self._in_use: set[int] = set()
        self._closed = False
        self._warmers: list[threading.Thread] = []
        for _ in range(warm):
            self._warm_one()

    def _new(self) -> Sandbox:
        sb = self._factory()
        sb.start()
        return sb

    def _warm_one(self) -> None:
        if not self._slots.acquire(blocking=False):
            return

        def work() -> None:
            try:
                sb = self._new()
            except SandboxError:
                self._slots.release()
                return
            with self._lock:
                if self._closed:
                    sb.close()
                    self._slots.release()
                    return
                self._idle.append(sb)

        t = threading.Thread(target=work, daemon=True)
        self._warmers.append(t)
        t.start()

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A started sandbox for one trial; blocks while `size` are in use."""
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            if self._idle:
                sb = self._idle.pop()
                self._in_use.add(id(sb))
                return sb
        if not self._slots.acquire(timeout=timeout):
            raise SandboxError(f"no free sandbox after {timeout} s (pool size {self.size})")
        try:
            sb = self._new()
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._in_use.add(id(sb))
        return sb

    def release(self, sb: Sandbox) -> None:
        """Destroy a sandbox handed out by `acquire` and free its slot."""
        with self._lock:
            if id(sb) not in self._in_use:
                return
            self._in_use.discard(id(sb))
        try:
            sb.close()
        finally:
            self._slots.release()
            with self._lock:
                refill = not self._closed and len(self._idle) < self.warm
            if refill:
                self._warm_one()

    @contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for t in self._warmers:
            t.join(timeout=60)
        with self._lock:
            idle += self._idle
            self._idle = []
        for sb in idle:
            sb.close()
            self._slots.release()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
