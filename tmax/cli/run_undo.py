"""`/undo [K]` in `tmax run`: put the sandbox's files back as they were before the last K
commands (`sandbox.snapshot`), and tell the model what was undone.

Snapshots are taken only with `--undo-steps N` (N > 0): the last N commands can be undone.
"""

from __future__ import annotations

import shlex
from tmax.sandbox.base import Sandbox, SandboxError, SnapshotScope
from tmax.sandbox.snapshot import UndoHistory, snapshot_store
from tmax.sandbox.undo_store import Restored

UNDO_WORD = "/undo"


def is_undo(text: str) -> bool:
    words = text.strip().split()
    return bool(words) and words[0].lower() == UNDO_WORD


def undo_count(text: str) -> int:
    """`/undo` -> 1, `/undo 3` -> 3; anything else is a ValueError with the reason."""
    words = text.strip().split()
    if len(words) == 1:
        return 1
    if len(words) == 2 and words[1].isdigit() and int(words[1]) > 0:
        return int(words[1])
    raise ValueError(f"usage: /undo [K] with K a positive number of commands, not {text.strip()!r}")


SHOWN_PATHS = 40  # per list in the message; the rest is counted


def _paths(label: str, paths: list[str]) -> str:
    if not paths:
        return ""
    more = f" (and {len(paths) - SHOWN_PATHS} more)" if len(paths) > SHOWN_PATHS else ""
    return f"\n{label}: {', '.join(paths[:SHOWN_PATHS])}{more}"


def untracked_note(scope: SnapshotScope | None, workdir: str) -> str:
    """What an undo whose snapshots cover `scope` (`SandboxCapabilities.snapshot`) cannot reach."""
    if scope == "workdir":
        return (f"Only files under {workdir} are tracked: anything those commands changed elsewhere on the host "
                "(/tmp, the home directory, installed packages) is as it is now.")
    if scope == "jail":
        return "Every place the jail can write (the workspace, /tmp and $HOME) is tracked."
    return "The container's whole filesystem is tracked (mounted volumes are not)."


def undo_message(commands: list[str], restored: Restored, untracked: str) -> str:
    """What the model is told (a user message) after an undo: the commands, exactly which paths
    came back, and what was not rolled back."""
    listed = "\n".join(f"{i}. {cmd}" for i, cmd in enumerate(commands, 1))
    n = len(commands)
    if restored.empty:
        what = "\nNo tracked file had changed since, so no file was touched."
    else:
        what = (_paths("Put back as they were", restored.changed) + _paths("Deleted (created since)", restored.removed)
                + _paths("Brought back (deleted since)", restored.recreated))
    return (
        f"[The user undid your last {n} command{'s' if n > 1 else ''}; the files are back as they were "
        f"before this ran:\n{listed}{what}\n{untracked} Not rolled back: running processes and the shell "
        "itself (working directory, variables).]"
    )


class UndoControl:
    """Snapshots before each command and `/undo K` for one sandbox."""

    def __init__(self, box: Sandbox, keep: int) -> None:
        self.box = box
        self.history = UndoHistory(snapshot_store(box), keep)

    def before(self, command: str) -> None:
        self.history.before(command)

    def undo(self, text: str) -> str:
        """Perform `/undo [K]`; returns the message for the model. ValueError: nothing done."""
        undone = self.history.undo(undo_count(text))
        # A directory the shell stood in may have been replaced: step back into it by name.
        fallback = getattr(self.box.shell, "workdir", None) or "/"
        self.box.run(f"cd -- \"$PWD\" 2>/dev/null || cd -- {shlex.quote(str(fallback))}", timeout=30)
        return undo_message(undone.commands, undone.restored, untracked_note(self.box.capabilities.snapshot, fallback))

    def close(self) -> None:
        try:
            self.history.close()
        except SandboxError:
            pass  # the snapshots go with the sandbox anyway
