"""Pools of sandboxes for concurrent trials and rollouts.

Every acquire hands out a fresh sandbox (state never leaks from one episode to the
next: a released sandbox is destroyed, never handed out again). What a pool saves is
the start-up: sandboxes are started ahead of need, in the background, so an episode
does not wait for a container to start.

`WarmPool` serves many environments (a key per task image and limits) under one cap on
the sandboxes alive at once; `prewarm(key, factory)` starts one for an episode that is
coming. `WarmAhead` decides which coming episodes get one: the next in line, as many as
the pool holds beyond the running ones (bench jobs, held-out evals, SFT demonstrations and
the RL loop alike). `SpecPool` is the one-environment case that keeps `warm` sandboxes
ready.

`SandboxPool` is what every pool does (`WarmPool`, `sandbox.overlay_pool.OverlayPool`), and
`sandbox.pool_factory.make_pool` the one place that picks a pool for a sandbox kind: callers
ask a pool's `capabilities`, never its class or their sandbox kind.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from tmax.sandbox import make_sandbox, sandbox_class
from tmax.sandbox.base import Forked, Sandbox, SandboxCapabilities, SandboxError, SandboxSpec

Factory = Callable[[], Sandbox]
T = TypeVar("T")


class SpecFactory:
    """A sandbox to make: its kind and spec, which a pool may read (the overlay pool does).
    A spec with a files layer, which only an overlay episode serves, makes a container of
    `own_image()`: the spec of the task's own image, built when it is called."""

    def __init__(self, kind: str, spec: SandboxSpec, own_image: Callable[[], SandboxSpec] | None = None):
        self.kind, self.spec, self.own_image = kind, spec, own_image

    def __call__(self) -> Sandbox:
        spec = self.spec
        if spec.files is not None and self.own_image is not None:
            spec = self.own_image()
        return make_sandbox(self.kind, spec)  # which refuses a files layer


class SandboxPool(Protocol):
    """A pool of sandboxes for episodes: each `acquire` hands out a fresh, started one, which
    `release` destroys (or ends); `prewarm` starts one ahead for an episode that is coming."""

    capacity: int  # the running episodes and those started ahead (what `WarmAhead` fills up to)
    warm_hits: int  # acquires that found theirs started

    @property
    def cold_starts(self) -> int:
        """Acquires that had to start theirs."""
        ...

    def capabilities(self, factory: SpecFactory | None = None) -> SandboxCapabilities:
        """What the sandboxes `acquire(key, factory)` hands out can do; without a factory,
        what this pool's sandboxes can do whatever their spec, as far as the pool knows."""
        ...

    def prewarm(self, key: Hashable, factory: SpecFactory) -> bool:
        """Start a sandbox for a coming `acquire(key, factory)` in the background; False when
        nothing was started (no room, or one is there)."""
        ...

    def acquire(self, key: Hashable, factory: SpecFactory, timeout: float | None = None) -> Sandbox: ...

    def fork(self, sb: Sandbox) -> Forked:
        """`sb.fork()` for a sandbox handed out by `acquire`; the child is the pool's too."""
        ...

    def release(self, sb: Sandbox) -> None: ...

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until the starts under way are done; False on timeout."""
        ...

    def close(self, in_use: bool = False) -> None:
        """Destroy what the pool holds (with `in_use`, the sandboxes handed out too)."""
        ...


def _started(factory: Factory) -> Sandbox:
    sb = factory()
    try:
        sb.start()
    except BaseException:
        sb.close()
        raise
    return sb


class WarmPool:
    """At most `capacity` sandboxes alive (idle, in use or starting), over any keys."""

    def __init__(self, capacity: int, close_in_background: bool = True):
        if capacity < 1:
            raise ValueError("pool size must be at least 1")
        self.capacity = capacity
        self.close_in_background = close_in_background
        self._cond = threading.Condition()
        self._idle: dict[Hashable, list[Sandbox]] = {}
        self._starting: dict[Hashable, int] = {}  # warm starts under way, per key
        self._waiters: dict[Hashable, int] = {}  # acquires waiting for those, per key
        self._in_use: dict[int, Sandbox] = {}
        self._cold_starting = 0  # acquires starting their own sandbox, outside the lock
        self._total = 0
        self._closed = False
        self._warmers: list[threading.Thread] = []
        self._closers: list[threading.Thread] = []
        self.warm_hits = 0
        self.cold_starts = 0
        self.warm_failures = 0

    def _idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def prewarm(self, key: Hashable, factory: Factory) -> bool:
        """Start a sandbox for `key` in the background if there is room; False if not."""
        with self._cond:
            if self._closed or self._total >= self.capacity:
                return False
            self._total += 1
            self._starting[key] = self._starting.get(key, 0) + 1

        def work() -> None:
            try:
                sb = _started(factory)
            except Exception:
                # A warm start that fails costs nothing: the episode starts its own (and
                # reports the failure as its own infrastructure error).
                with self._cond:
                    self._total -= 1
                    self._starting[key] -= 1
                    self.warm_failures += 1
                    self._cond.notify_all()
                return
            with self._cond:
                self._starting[key] -= 1
                keep = not self._closed
                if keep:
                    self._idle.setdefault(key, []).append(sb)
                else:
                    self._total -= 1
                self._cond.notify_all()
            if not keep:
                sb.close()

        t = threading.Thread(target=work, daemon=True, name="tmax-pool-warm")
        with self._cond:
            self._warmers = [w for w in self._warmers if w.is_alive()] + [t]
        t.start()
        return True

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until no warm start is under way (the pool is as full as it will get);
        False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or not any(self._starting.values()), timeout)

    def _evict_locked(self, key: Hashable) -> Sandbox | None:
        """An idle sandbox of another key, taken out to make room (closed by the caller)."""
        for k, sbs in self._idle.items():
            if k != key and sbs:
                self._total -= 1
                return sbs.pop(0)
        return None

    def acquire(self, key: Hashable, factory: Factory, timeout: float | None = None) -> Sandbox:
        """A started sandbox for `key`: a warm one if there is one or one is starting (it is
        waited for), else a new one; blocks while `capacity` sandboxes exist and none of
        them is idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        evicted: Sandbox | None = None
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxError("sandbox pool is closed")
                if self._idle.get(key):
                    sb = self._idle[key].pop(0)
                    self._in_use[id(sb)] = sb
                    self.warm_hits += 1
                    return sb
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise SandboxError(f"no free sandbox after {timeout} s (pool size {self.capacity})")
                if self._starting.get(key, 0) > self._waiters.get(key, 0):
                    # One is starting for this key: waiting for it beats starting another.
                    self._waiters[key] = self._waiters.get(key, 0) + 1
                    try:
                        self._cond.wait(wait)
                    finally:
                        self._waiters[key] -= 1
                    continue
                if self._total >= self.capacity:
                    evicted = self._evict_locked(key)
                if self._total < self.capacity:
                    self._total += 1
                    self.cold_starts += 1
                    self._cold_starting += 1
                    break
                self._cond.wait(wait)
        if evicted is not None:
            evicted.close()
        return self._cold_start(factory)

    def _cold_start(self, factory: Factory) -> Sandbox:
        """Start a sandbox for an acquire (its slot is counted). A pool closed meanwhile closes
        it and refuses: `close` waits for cold starts, so none outlives a closed pool."""
        handed_out = False
        try:
            sb = _started(factory)
            with self._cond:
                if not self._closed:
                    self._in_use[id(sb)] = sb
                    handed_out = True
                    return sb
            sb.close()
            raise SandboxError("sandbox pool is closed")
        finally:
            with self._cond:
                self._cold_starting -= 1
                if not handed_out:
                    self._total -= 1
                self._cond.notify_all()

    def capabilities(self, factory: Factory | None = None) -> SandboxCapabilities:
        """What the sandboxes `acquire(key, factory)` hands out can do: what their kind's can
        (`SpecFactory.kind`); nothing known beyond the protocol without it."""
        kind = getattr(factory, "kind", None)
        return sandbox_class(kind).capabilities if kind else SandboxCapabilities()

    def fork(self, sb: Sandbox) -> Forked:
        """`sb.fork()` for a sandbox handed out by `acquire`: the child is this pool's too (its
        `release`, its `close(in_use=True)`), beyond the pool's capacity."""
        forked = sb.fork()
        with self._cond:
            self._in_use[id(forked.sandbox)] = forked.sandbox
            self._total += 1
        return forked

    def release(self, sb: Sandbox) -> None:
        """Destroy a sandbox handed out by `acquire` (with `close_in_background`, in a
        thread: the caller's next episode need not wait for a container to be removed);
        its slot is free once it is gone."""
        with self._cond:
            if id(sb) not in self._in_use:
                return
            del self._in_use[id(sb)]

        def work() -> None:
            try:
                sb.close()
            finally:
                with self._cond:
                    self._total -= 1
                    self._cond.notify_all()
                self._released()

        if not self.close_in_background:
            work()
            return
        t = threading.Thread(target=work, daemon=True, name="tmax-pool-close")
        with self._cond:
            self._closers = [c for c in self._closers if c.is_alive()] + [t]
        t.start()

    def _released(self) -> None:
        """Hook for subclasses that refill after a release."""

    def close(self, in_use: bool = False) -> None:
        """Destroy the idle sandboxes; ones still in use are closed by their release, or
        now with `in_use` (a worker shutting down: its episodes end as infra errors rather
        than leave containers behind)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._warmers) + list(self._closers)
        for t in threads:
            t.join(timeout=120)
        with self._cond:
            self._cond.wait_for(lambda: self._cold_starting == 0, timeout=120)
            idle = [sb for sbs in self._idle.values() for sb in sbs]
            self._idle = {}
            self._total -= len(idle)
            busy = list(self._in_use.values()) if in_use else []
        for sb in idle + busy:
            try:
                sb.close()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WarmAhead(Generic[T]):
    """Starts sandboxes ahead for the episodes next in line, `depth` of them at most.

    `start(item) -> bool` starts one coming episode's sandbox (in a `WarmPool`, which does
    it in the background); False when there was no room. `fill(upcoming)`, given the coming
    episodes in the order they will begin, starts one for each of the first `depth` that has
    none yet (each item once, told apart by `key`); a start that found no room is given back,
    for a later fill to try again."""

    def __init__(self, depth: int, start: Callable[[T], bool], key: Callable[[T], Hashable] = lambda item: item):
        self.depth, self.start, self.key = max(0, depth), start, key
        self._claimed: set[Hashable] = set()
        self._lock = threading.Lock()

    def fill(self, upcoming: Iterable[T]) -> int:
        """Start sandboxes for the next in line; how many were started."""
        with self._lock:
            picked = [item for item in itertools.islice(upcoming, self.depth) if self.key(item) not in self._claimed]
            self._claimed.update(self.key(item) for item in picked)
        started = 0
        for item in picked:
            if self.start(item):
                started += 1
            else:
                with self._lock:
                    self._claimed.discard(self.key(item))
        return started

    def fill_after(self, items: Sequence[T], index: int, running: int) -> int:
        """Episode `index` of `items`, which run in order `running` at a time, begins: the
        ones after the running ones are next in line."""
        return self.fill(itertools.islice(items, max(index + 1, running), None))


class SpecPool(WarmPool):
    """One environment: `size` sandboxes at most, `warm` of them kept started ahead."""

    _KEY = "default"

    def __init__(self, kind: str, spec: SandboxSpec | None = None, size: int = 4, warm: int = 0,
                 factory: Factory | None = None, **options):
        super().__init__(size, close_in_background=False)
        if not 0 <= warm <= size:
            raise ValueError("warm must be between 0 and the pool size")
        self.size = size
        self.warm = warm
        self._factory = factory or (lambda: make_sandbox(kind, spec, **options))
        for _ in range(warm):
            self.prewarm(self._KEY, self._factory)

    def acquire(self, timeout: float | None = None) -> Sandbox:  # type: ignore[override]
        return super().acquire(self._KEY, self._factory, timeout)

    def _released(self) -> None:
        with self._cond:
            short = self.warm - len(self._idle.get(self._KEY, []))
        for _ in range(max(0, short)):
            self.prewarm(self._KEY, self._factory)

    @contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(timeout)
        try:
            yield sb
        finally:
            self.release(sb)
