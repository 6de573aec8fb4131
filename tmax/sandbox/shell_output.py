"""What a command printed on the pty, made readable and kept in bounded memory."""

from __future__ import annotations

import re

# CSI (colours, cursor moves), OSC (titles, hyperlinks), two-char ESC sequences, and
# the remaining C0 controls except \t and \n (\r is handled separately).
_ANSI_RE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"
    r"|\x1b[ -/]*[0-~]"
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"
)


def clean_output(text: str) -> str:
    """Strip terminal control sequences and render carriage returns the way a terminal
    shows them: a progress bar redrawn with `\\r` keeps only its last state."""
    text = _ANSI_RE.sub("", text)
    text = re.sub(r"\r+\n", "\n", text)
    if "\r" in text:
        lines = []
        for line in text.split("\n"):
            if "\r" in line:
                parts = [p for p in line.split("\r") if p]
                line = parts[-1] if parts else ""
            lines.append(line)
        text = "\n".join(lines)
    return text


class BoundedOutput:
    """Keeps the first and last `limit / 2` characters of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head: list[str] = []
        self.head_len = 0
        self.tail: list[str] = []
        self.tail_len = 0
        self.dropped = 0

    def add(self, s: str) -> None:
        if not s:
            return
        if self.head_len < self.head_limit:
            take = s[: self.head_limit - self.head_len]
            self.head.append(take)
            self.head_len += len(take)
            s = s[len(take):]
            if not s:
                return
        self.tail.append(s)
        self.tail_len += len(s)
        # Trim lazily (at twice the window) so a flood of small chunks stays linear.
        if self.tail_len > 2 * self.tail_limit:
            joined = "".join(self.tail)
            cut = len(joined) - self.tail_limit
            self.dropped += cut
            self.tail = [joined[cut:]]
            self.tail_len = self.tail_limit

    def text(self) -> tuple[str, int]:
        tail = "".join(self.tail)
        dropped = self.dropped
        if len(tail) > self.tail_limit:
            dropped += len(tail) - self.tail_limit
            tail = tail[len(tail) - self.tail_limit:]
        head = "".join(self.head)
        if dropped:
            head = clean_output(head)
            tail = clean_output(tail)
            # Start the tail at a line boundary so the cut is visible and clean.
            nl = tail.find("\n")
            if 0 <= nl < 200:
                dropped += nl + 1
                tail = tail[nl + 1:]
            return head + f"\n[... {dropped} characters dropped ...]\n" + tail, dropped
        return clean_output(head + tail), 0
