"""How `shell.PersistentShell` talks to its bash over the pty: the command line it types
for each command, and the reader that finds where the command's output ends.

How a command's end and exit code are found: PS1 is set to a line carrying a random
per-session tag, a per-command sequence number and `$?`. The tag is never printed by
anything but the prompt, so output cannot forge the marker without knowing it; the
sequence number makes a stale prompt (e.g. one printed after a late Ctrl-C) harmless.

How a command is sent: its text goes into the shell as the body of a quoted heredoc
that a builtin `read` stores in a variable, then `eval` runs it with stdin from
/dev/null, all in one top-level command line:

    __tmax_rc=$?; __tmax_seq=N; IFS= read -r -d '' __tmax_cmd <<'TAG_EOF' || :;
      if __tmax_ret "$__tmax_rc"; then eval "$__tmax_cmd"; else eval "$__tmax_cmd"; fi </dev/null
    <command text, verbatim>
    TAG_EOF
    <empty line>

Why this shape:
* stdin: a command that reads stdin (`cat`, `read x`, `python` with no script) gets EOF
  at once instead of blocking the session until the timeout, and can never swallow the
  next command's text. Redirecting per command is robust: it needs no guessing about
  whether a program is waiting for input, and background jobs started by the command
  inherit /dev/null too.
* syntax: an unbalanced quote or unterminated heredoc inside the command fails inside
  `eval` with bash's own syntax error (exit 2) instead of leaving the shell waiting
  for continuation lines until the timeout.
* the quoted delimiter keeps the text verbatim (no expansion), multi-line commands and
  heredocs work, and aliases defined on one line apply to the next (eval parses line by
  line). `read` and `eval` are builtins: no process is spawned per command.
* `$?` is saved before the line's own assignments and restored for the command, so
  `echo $?` reports the previous command, as in a terminal.
* the trailing empty line re-prints the prompt with `$?` unchanged. Interactive bash
  prints no prompt after a syntax error inside `eval`; this line brings it back.
"""

from __future__ import annotations

import codecs
import re
import time
from collections.abc import Callable

from tmax.sandbox.ptyspawn import PtyProcess, ReadTimeout
from tmax.sandbox.shell_output import BoundedOutput

# Control characters that readline would act on if they reached it inside a command
# (Ctrl-C raises SIGINT, ESC starts a key sequence, DEL deletes); commands keep \t and \n.
_COMMAND_CTRL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

# What the reader answers: (the raw text when no buffer was given, the exit code, timed out, EOF).
Collected = tuple[str, int, bool, bool]


def command_line(tag: str, seq: int, command: str, save: bool = True) -> str:
    """The text typed into the shell to run `command` as number `seq` (see the module
    docstring); `save`: the shell saves its state for a restart first (`__tmax_save`)."""
    # Normalise line ends and drop control characters readline would act on.
    command = command.replace("\r\n", "\n").replace("\r", "\n")
    command = _COMMAND_CTRL_RE.sub(lambda m: m.group(0) if m.group(0) in "\t\n" else "", command)
    delim = f"__TMAX_{tag}_EOF"
    # `$?` is saved first and handed back through the `if`: in bash the then/else
    # branch starts with `$?` set to the condition's status, so the command sees
    # the previous command's exit code, and a non-zero one cannot trip `set -e`
    # (a condition never does).
    return (
        f"__tmax_rc=$?; __tmax_seq={seq};{' __tmax_save;' if save else ''} IFS= builtin read -r -d '' __tmax_cmd <<'{delim}' || :;"
        ' if __tmax_ret "$__tmax_rc"; then eval "$__tmax_cmd"; else eval "$__tmax_cmd"; fi </dev/null\n'
        f"{command}\n{delim}\n"
        # An empty line: it re-prints the prompt with `$?` unchanged. After a syntax
        # error inside `eval`, interactive bash skips the prompt, and this is what
        # brings it back; otherwise it yields a duplicate prompt for this sequence
        # number, which the next command drops as stale.
        "\n"
    )


class PromptReader:
    """Reads one shell's pty up to the prompt that ends a command, keeping what follows it
    for the next read. Output goes to a `BoundedOutput` (head and tail of at most
    `max_output_chars`) and, piece by piece as it arrives, to a listener."""

    def __init__(self, tag: str, max_output_chars: int):
        self.tag = tag
        self.max_output_chars = max_output_chars
        self._marker_rx = re.compile(r"\r*\n__TMAX_" + tag + r"_(\d*)_(\d+)__\r*\n")
        self._keep = 128  # longer than any marker: kept unsearched-committed between reads
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._leftover = ""

    def reset(self) -> None:
        """Forget what an earlier shell left (a restarted shell starts a new stream)."""
        self._decoder.reset()
        self._leftover = ""

    def collect(self, child: PtyProcess, seq: int | None, deadline: float | None, buf: BoundedOutput | None = None,
                listener: Callable[[str], None] | None = None) -> Collected:
        """Read until the prompt for `seq` (None: any prompt). Output before it goes to
        `buf` in bounded memory and to `listener` (also "" about twice a second while
        nothing arrives); returns (raw text if no buf, rc, timed_out, eof)."""
        sink = buf if buf is not None else BoundedOutput(self.max_output_chars)
        pending, self._leftover = self._leftover, ""
        want = "" if seq is None else str(seq)

        def answer(rc: int, timed_out: bool = False, eof: bool = False) -> Collected:
            return ("" if buf is not None else sink.text()[0]), rc, timed_out, eof

        while True:
            m = self._marker_rx.search(pending)
            while m is not None:
                if seq is None or m.group(1) == want:
                    sink.add(pending[: m.start()])
                    self._leftover = pending[m.end():]
                    return answer(int(m.group(2)))
                # A stale prompt (earlier command, idle Ctrl-C): drop it, keep looking.
                pending = pending[: m.start()] + pending[m.end():]
                m = self._marker_rx.search(pending)
            if len(pending) > self._keep:
                sink.add(pending[: -self._keep])
                pending = pending[-self._keep:]
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                sink.add(pending)
                return answer(124, timed_out=True)
            try:
                # Wake up now and then: a background job holding the pty open delays
                # EOF after the shell itself exited, so liveness is checked directly.
                data = child.read_nonblocking(1 << 16, timeout=0.5 if wait is None else min(wait, 0.5))
            except ReadTimeout:
                self._stream("", listener)
                if not child.isalive():
                    sink.add(pending + self._drain(child))
                    return answer(1, eof=True)
                continue
            except EOFError:
                sink.add(pending + self._decoder.decode(b"", final=True))
                return answer(1, eof=True)
            text = self._decoder.decode(data)
            pending += text
            self._stream(text, listener)

    def _stream(self, text: str, listener: Callable[[str], None] | None) -> None:
        """Hand a piece of a running command's output to `listener`, less any prompt marker
        (or the start of one, cut at the end of the piece)."""
        if listener is None:
            return
        text = self._marker_rx.sub("", text)  # the prompt brings its own newlines
        cut = text.rfind("\n__TM")
        if cut >= 0 and f"__TMAX_{self.tag}_".startswith(text[cut + 1:][:len(self.tag) + 7]):
            text = text[:cut]
        try:
            listener(text)
        except Exception:
            pass  # a display must never break the command it shows

    def _drain(self, child: PtyProcess) -> str:
        """Whatever is still buffered on the pty of a dead shell."""
        out = ""
        for _ in range(64):
            try:
                out += self._decoder.decode(child.read_nonblocking(1 << 16, timeout=0))
            except (ReadTimeout, EOFError, OSError):
                break
        return out + self._decoder.decode(b"", final=True)
