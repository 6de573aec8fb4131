"""The one place that picks a sandbox pool (`sandbox.pool.SandboxPool`) for a sandbox kind.

Everything else holds a pool as a `SandboxPool` and asks its `capabilities` (overlay, fork,
snapshot, limits, network), never its class or the sandbox kind behind it.
"""

from __future__ import annotations

from pathlib import Path

from tmax.sandbox.overlay_pool import OverlayPool
from tmax.sandbox.pool import SandboxPool, WarmPool


def pool_serves_overlays(kind: str, overlay: bool) -> bool:
    """Whether `make_pool(kind, overlay=overlay, ...)` hands out overlay episodes (podman)."""
    return overlay and starts_ahead(kind)


def starts_ahead(kind: str) -> bool:
    """Whether episodes of sandbox `kind` start slowly enough (a container) that a pool starts
    them ahead of need; host sandboxes start in no time."""
    return kind == "podman"


def make_pool(kind: str, slots: int, ahead: int = 0, *, overlay: bool = False,
              host_labels: dict[str, str] | None = None, root: Path | None = None,
              close_in_background: bool = True) -> SandboxPool | None:
    """The pool for `slots` episodes at once of sandbox `kind`, `ahead` more started for the
    episodes next in line: with `overlay` on podman, episodes as overlays of containers shared
    on this machine (carrying `host_labels`); else on podman with `ahead`, a fresh container
    per episode; None where episodes start their own (host sandboxes start in no time)."""
    if pool_serves_overlays(kind, overlay):
        return OverlayPool(slots, ahead, host_labels=host_labels, root=root, close_in_background=close_in_background)
    if starts_ahead(kind) and ahead > 0:
        return WarmPool(slots + ahead, close_in_background)
    return None
