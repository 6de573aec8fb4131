"""What an undo store is (`SnapshotStore`: save, restore, drop, close) and what a restore
changed (`Restored`). Both stores implement it, `sandbox.watched.WatchedSnapshots` (host
directories) and `sandbox.snapshot.ContainerSnapshots` (podman); `sandbox.snapshot.UndoHistory`
drives either."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Restored:
    """What a restore changed, as paths seen inside the sandbox."""

    changed: list[str] = field(default_factory=list)  # put back as they were
    removed: list[str] = field(default_factory=list)  # created since the snapshot: deleted
    recreated: list[str] = field(default_factory=list)  # deleted since the snapshot: back

    def __add__(self, other: "Restored") -> "Restored":
        return Restored(self.changed + other.changed, self.removed + other.removed, self.recreated + other.recreated)

    @property
    def empty(self) -> bool:
        return not (self.changed or self.removed or self.recreated)


class SnapshotStore(Protocol):
    def save(self, n: int) -> None:
        """Snapshot the current state as number n."""
        ...

    def restore(self, n: int) -> "Restored":
        """Put snapshot n back; says which paths that changed."""
        ...

    def drop(self, n: int) -> None: ...

    def close(self) -> None: ...
