"""Terminal rendering (rich) and line input (prompt-toolkit) for `tmax run` / `tmax show`.

Everything the model or a command produced is rendered as `rich.text.Text`, never as
markup, so brackets in output cannot restyle or hide text.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from tmax.sandbox.shell_output import clean_output

if TYPE_CHECKING:
    from tmax.agents.compaction import CompactionRecord, ContextUse
    from tmax.agents.policy import Usage

T = TypeVar("T")

# Live output is clipped for the screen only; a live run keeps the whole of a long output in
# its run directory (`outputs/`), a saved trajectory shows what the model saw.
SCREEN_HEAD_LINES = 40
SCREEN_TAIL_LINES = 20

_EXIT_RE = re.compile(r"\n*\(exit_code=(-?\d+)\)\s*$")

HELP = (
    "At a command: Enter runs it, other text rejects it and tells the model why. "
    "Anywhere: /y yolo (run without asking) · /c confirm each command · /undo [K] restore the files from "
    "before the last K commands (with --undo-steps) · /compact [what to keep in focus] summarise the session "
    "now · /usage tokens, cost and context so far · /good, /bad rate the session · /q quit · /h help · "
    "Ctrl-C interrupts the model or the command; a second Ctrl-C kills a command that ignores it."
)


def fmt_tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else str(n)


def fmt_context(c: ContextUse) -> str:
    """`agents.compaction.ContextUse` in a few words: used, window, left."""
    return f"context {fmt_tokens(c.used)} of {fmt_tokens(c.window)} ({fmt_tokens(c.left)} left)"


def fmt_cost(usd: float) -> str:
    return f"${usd:.4f}" if usd < 1 else f"${usd:.2f}"


def clip_lines(text: str, head: int = SCREEN_HEAD_LINES, tail: int = SCREEN_TAIL_LINES, where: str = "the trajectory") -> str:
    lines = text.splitlines()
    if len(lines) <= head + tail + 1:
        return text
    hidden = len(lines) - head - tail
    return "\n".join(lines[:head] + [f"... {hidden} lines not shown (all of it is in {where}) ..."] + lines[-tail:])


def split_exit_code(observation: str) -> tuple[str, int | None]:
    """Observations end with `(exit_code=N)`; return the body and N."""
    m = _EXIT_RE.search(observation)
    if not m:
        return observation, None
    return observation[: m.start()], int(m.group(1))


LIVE_LINES = 8  # last lines of a running command's output shown under the spinner


class LiveOutput:
    """A running command as the screen shows it: the status line with the time it has run,
    then the last lines of its output. Rendered by rich at each refresh (so the time moves
    on without output); `add` is called from the thread reading the command."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.started = time.monotonic()
        self._lines: deque[str] = deque(maxlen=LIVE_LINES)
        self._partial = ""
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        if not text:
            return
        with self._lock:
            lines = (self._partial + text.replace("\r\n", "\n")).split("\n")
            self._partial = lines.pop()
            self._lines.extend(clean_output(line) for line in lines)

    def __rich__(self) -> RenderableType:
        with self._lock:
            shown = [*self._lines, clean_output(self._partial)] if self._partial else list(self._lines)
        head = Text(f"{self.title} · {time.monotonic() - self.started:.0f}s")
        tail = [line for line in shown if line.strip()][-LIVE_LINES:]
        return Group(head, Text("\n".join(tail), style="dim")) if tail else head


class Display:
    """Step-by-step rendering shared by the live run and the saved-trajectory viewer."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self._status = None

    # -- spinner ------------------------------------------------------------------
    def start_spinner(self, text: str) -> None:
        self.stop_spinner()
        self._status = self.console.status(Text(text), spinner="dots")
        self._status.start()

    def start_live(self, title: str) -> LiveOutput:
        """A spinner over a running command's elapsed time and last output lines."""
        live = LiveOutput(title)
        self.stop_spinner()
        self._status = self.console.status(live, spinner="dots", refresh_per_second=4)
        self._status.start()
        return live

    def stop_spinner(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    # -- blocks -------------------------------------------------------------------
    def step_header(self, step: int, max_steps: int | None = None) -> None:
        total = f"/{max_steps}" if max_steps else ""
        self.console.rule(Text(f"Step {step}{total}", style="bold cyan"), align="left", style="cyan")

    def task(self, text: str, title: str = "task") -> None:
        self.console.print(Panel(Text(text), title=title, title_align="left", border_style="magenta"))

    def thought(self, text: str | None) -> None:
        text = (text or "").strip()
        if text:
            self.console.print(Text(text, style="italic"))

    def command(self, cmd: str) -> None:
        body = Syntax(cmd, "bash", theme="ansi_dark", word_wrap=True, background_color="default")
        self.console.print(Panel(body, title="command", title_align="left", border_style="yellow"))

    def output(
        self,
        output: str,
        exit_code: int | None,
        duration_s: float | None = None,
        timed_out: bool = False,
        note: str | None = None,
        kept: str | None = None,
    ) -> None:
        """`kept`: the file holding the whole output, when it was too long to show or send."""
        body = output.rstrip("\n")
        parts: list[Any] = [Text(clip_lines(body, where=kept or "the trajectory") if body else "(no output)", style="" if body else "dim")]
        if note:
            parts.append(Text(note, style="yellow"))
        if kept:
            parts.append(Text(f"whole output: {kept}", style="dim"))
        bits = []
        if exit_code is not None:
            bits.append(f"exit {exit_code}")
        if timed_out:
            bits.append("timed out")
        if duration_s is not None:
            bits.append(f"{duration_s:.1f}s")
        colour = "green" if exit_code == 0 else "red"
        self.console.print(
            Panel(
                Group(*parts),
                title="output",
                title_align="left",
                subtitle=Text(" · ".join(bits), style=colour) if bits else None,
                subtitle_align="right",
                border_style=colour if exit_code is not None else "white",
            )
        )

    def usage(self, turn: Usage, total: Usage, latency_s: float | None = None, context: ContextUse | None = None) -> None:
        """After a turn: its tokens, the context window's use, the session's totals and cost."""
        line = f"tokens: {fmt_tokens(turn.prompt_tokens)} prompt + {fmt_tokens(turn.completion_tokens)} completion"
        if context is not None:
            line += f" · {fmt_context(context)}"
        line += f" · session {fmt_tokens(total.prompt_tokens)} / {fmt_tokens(total.completion_tokens)}"
        if total.cost_usd:
            line += f" · {fmt_cost(total.cost_usd)}"
        if latency_s:
            line += f" · model {latency_s:.1f}s"
        self.console.print(Text(line, style="dim"))

    def usage_report(self, total: Usage, context: ContextUse | None) -> None:
        """`/usage`: the session's totals so far."""
        cost = fmt_cost(total.cost_usd) if total.cost_usd else "not known (no prices: price_input / price_output in the config)"
        lines = [f"Session: {total.prompt_tokens:,} prompt + {total.completion_tokens:,} completion tokens"
                 f" ({total.reasoning_tokens:,} reasoning) · cost {cost}"]
        if context is not None:
            auto = (f"compacts at {context.threshold:.0%} ({fmt_tokens(int(context.threshold * context.window))})"
                    if context.threshold else "automatic compaction off")
            lines.append(f"Context: {context.used:,} of {context.window:,} tokens used, {context.left:,} left · {auto}"
                         f" · compactions so far: {context.compactions}")
        self.console.print(Panel(Text("\n".join(lines)), title="usage", title_align="left", border_style="cyan"))

    def compaction(self, record: CompactionRecord) -> None:
        """A compaction (`agents.compaction.CompactionRecord`), done or failed."""
        how = {"auto": "automatic", "manual": "on request", "overflow": "the server said the context was over its window"}[
            record.reason]
        if not record.ok:
            self.warn(f"Compaction ({how}) failed: {record.error}. The session keeps its whole context "
                      f"({fmt_tokens(record.tokens_before)} of {fmt_tokens(record.window)} tokens).")
            return
        after = f"{'~' if record.estimated else ''}{fmt_tokens(record.tokens_after or 0)}"
        kept = f"the task, {record.follow_ups} follow-up(s) and the last {record.kept_turns} turn(s)"
        head = (f"Context compacted ({how}, at {record.tokens_before / record.window:.0%} of the window): "
                f"{fmt_tokens(record.tokens_before)} -> {after} tokens. Kept word for word: {kept}.")
        if record.clipped or record.pieces > 1:
            head += (f" To fit the summary request in the window, {len(record.clipped)} long message(s) were cut "
                     f"(head and tail kept) and it was summarised in {record.pieces} piece(s).")
        body = Group(Text(head, style="bold"), Text(record.summary, style="dim"))
        self.console.print(Panel(body, title=f"compaction {record.segment}", title_align="left", border_style="magenta"))

    def feedback(self, text: str, title: str) -> None:
        self.console.print(Panel(Text(text), title=title, title_align="left", border_style="blue"))

    def format_error(self, feedback: str) -> None:
        self.console.print(Panel(Text(feedback), title="format error", title_align="left", border_style="red"))

    def note(self, text: str) -> None:
        self.console.print(Text(text, style="dim"))

    def info(self, text: str) -> None:
        self.console.print(Text(text, style="cyan"))

    def warn(self, text: str) -> None:
        self.console.print(Text(text, style="yellow"))

    def error(self, text: str) -> None:
        self.console.print(Text(text, style="bold red"))


class Prompter:
    """One line of input: prompt-toolkit (with a history file) on a terminal, plain stdin otherwise.

    `ask` raises EOFError on Ctrl-D / end of input and KeyboardInterrupt on Ctrl-C."""

    def __init__(self, history_file: Path | None = None) -> None:
        self._session = None
        if sys.stdin.isatty() and sys.stdout.isatty():
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import FileHistory, InMemoryHistory

            history = InMemoryHistory()
            if history_file is not None:
                try:
                    history_file.parent.mkdir(parents=True, exist_ok=True)
                    history = FileHistory(str(history_file))
                except OSError:
                    pass  # a read-only home must not stop the run
            self._session = PromptSession(history=history)

    @property
    def interactive(self) -> bool:
        return self._session is not None

    def ask(self, message: str) -> str:
        if self._session is not None:
            return self._session.prompt(message)
        sys.stdout.write(message)
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            sys.stdout.write("\n")
            raise EOFError
        # Piped input is not echoed; show it so a log of the session reads like the terminal.
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        return line.rstrip("\n")


def optional_chart(make: Callable[[], T]) -> T | None:
    """A chart (`make()`), or None with a one-line note on stderr when matplotlib (an
    extra) is missing: the command still does everything else."""
    from rich.markup import escape

    from tmax.tasks.charts import ChartsUnavailable

    try:
        return make()
    except ChartsUnavailable as e:
        Console(stderr=True, highlight=False).print(f"[yellow]note:[/] {escape(str(e))}")
        return None
