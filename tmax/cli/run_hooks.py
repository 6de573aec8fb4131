"""How `tmax run` talks to a person (`InteractiveHooks`: rich rendering, approval, Ctrl-C
guidance, `/` commands) or to a script (`JsonHooks`: one JSON event per line on stdout).
Both are `agents.loop.AgentHooks`: the loop calls them, they never drive it. Each gets what
it works with when it is made (the run directory, undo, rating, the stop flag that SIGTERM
sets)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tmax.agents.loop import AgentHooks

if TYPE_CHECKING:
    from tmax.agents.compaction import CompactionRecord, ContextUse
    from tmax.agents.fitting import Clip
    from tmax.agents.policy import ModelTurn, Usage
    from tmax.cli.run_undo import UndoControl
    from tmax.cli.ui import Display, LiveOutput, Prompter
    from tmax.sandbox.base import CommandResult
from tmax.sandbox.shell_output import clean_output
from tmax.cli.run_setup import keep_long_output

QUIT_WORDS = ("/q", "/quit", "/exit")
RUNNING_TEXT = "Running… (Ctrl-C interrupts the command; a second Ctrl-C kills it)"
WAITING_TEXT = "Waiting for the model… (Ctrl-C to interrupt)"
PROGRESS_EVERY_S = 1.0  # --json: the fastest progress events come while a command prints
PROGRESS_IDLE_S = 5.0  # --json: a progress event (elapsed time only) while it prints nothing


def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "cost_usd": round(u.cost_usd, 6),
    }


def context_dict(c: ContextUse | None) -> dict[str, Any] | None:
    """`agents.compaction.ContextUse` as a `--json` field."""
    if c is None:
        return None
    return {"used": c.used, "window": c.window, "left": c.left, "compaction_threshold": c.threshold,
            "compactions": c.compactions}


_EMIT_LOCK = threading.Lock()


def emit(type_: str, **fields: object) -> None:
    """One `--json` event: a JSON object on its own line on stdout."""
    with _EMIT_LOCK:  # progress comes from the thread reading the command
        sys.stdout.write(json.dumps({"type": type_, **fields}, default=str) + "\n")
        sys.stdout.flush()


class JsonHooks(AgentHooks):
    """Headless: one JSON object per line on stdout, no questions, Ctrl-C stops."""

    def __init__(self, session_usage: Callable[[], Usage], run_dir: Path, output_limit: int,
                 context: Callable[[], ContextUse | None] = lambda: None) -> None:
        self.session_usage = session_usage  # the agent's running totals (resets per run())
        self.context = context  # how full the context window is (agents.compaction.ContextUse)
        self.run_dir = run_dir  # where long outputs are kept
        self.output_limit = output_limit
        self.step = 0
        self.command_started: float | None = None  # monotonic time the running command started
        self._last_progress = 0.0
        self._pending = ""  # output not yet sent in a progress event
        self._clip: Clip | None = None  # the step's output, cut to fit the window

    def on_step_start(self, step: int) -> None:
        self.step = step
        emit("step", step=step)

    def on_command_output(self, text: str) -> None:
        """From the reading thread: a `progress` event with the output since the last one, at
        most every PROGRESS_EVERY_S while output comes, every PROGRESS_IDLE_S while none does."""
        if self.command_started is None:
            return
        self._pending += text
        now = time.monotonic()
        quiet = now - self._last_progress
        if (self._pending and quiet >= PROGRESS_EVERY_S) or quiet >= PROGRESS_IDLE_S:
            self._last_progress = now
            output, self._pending = clean_output(self._pending), ""
            emit("progress", step=self.step, elapsed_s=round(now - self.command_started, 1), output=output)

    def on_model_turn(self, step: int, turn: ModelTurn, command: str | None) -> None:
        emit(
            "model",
            step=step,
            content=turn.message.get("content"),
            command=command,
            finish_reason=turn.finish_reason,
            latency_s=round(turn.latency_s, 3),
            usage=usage_dict(turn.usage),
            cumulative=usage_dict(self.session_usage()),
            context=context_dict(self.context()),
        )

    def on_compaction_start(self, reason: str, context_tokens: int) -> None:
        use = self.context()
        emit("compaction_start", reason=reason, tokens=context_tokens, window=use.window if use else None)

    def on_compaction(self, record: CompactionRecord) -> None:
        emit("compaction", **record.model_dump(mode="json"))

    def on_output_clipped(self, step: int, clip: Clip) -> None:
        self._clip = clip

    def approve(self, step: int, command: str) -> str | None:
        emit("command", step=step, command=command)
        self.command_started = self._last_progress = time.monotonic()
        self._pending = ""
        return None

    def on_observation(self, step: int, result: CommandResult, observation: str) -> None:
        self.command_started = None
        kept = keep_long_output(self.run_dir, step, result, self.output_limit)
        emit(
            "observation",
            step=step,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            duration_s=round(result.duration_s, 3),
            note=result.note,
            observation=observation,
            output_file=str(kept) if kept else None,
            clipped=self._clip.model_dump(mode="json") if self._clip is not None else None,
        )
        self._clip = None

    def on_format_error(self, step: int, feedback: str, reason: str | None = None) -> None:
        emit("format_error", step=step, feedback=feedback, reason=reason)

    def on_retry(self, attempt: int, error: Exception, delay_s: float) -> None:
        emit("retry", attempt=attempt, error=str(error), delay_s=delay_s)

    def on_interrupt(self) -> str | None:
        return None

class InteractiveHooks(AgentHooks):
    """Rich rendering; approval, guidance and mode switches through the prompter."""

    def __init__(self, display: Display, prompter: Prompter | None, mode: str, max_steps: int | None,
                 session_usage: Callable[[], Usage], *, run_dir: Path, output_limit: int, stopping: threading.Event,
                 undo: UndoControl | None = None, rate: Callable[[str], str] | None = None,
                 context: Callable[[], ContextUse | None] = lambda: None,
                 compact: Callable[[str | None], CompactionRecord | None] | None = None) -> None:
        self.display = display
        self.prompter = prompter
        self.mode = mode
        self.max_steps = max_steps
        self.session_usage = session_usage
        self.stopping = stopping  # set by SIGTERM/SIGHUP (the session) or a quit at a prompt
        self.undo = undo  # tmax.cli.run_undo.UndoControl with --undo-steps
        self.undo_note: str | None = None  # what the model is told after an /undo
        self.rate = rate  # /good, /bad (agents.rating.rate)
        self.run_dir = run_dir  # where long outputs are kept
        self.output_limit = output_limit
        self.live: LiveOutput | None = None  # the running command's output
        self.context = context  # how full the context window is (agents.compaction.ContextUse)
        self.compact = compact  # /compact [focus]: now between tasks, else before the next model call

    # `/y` and `/c` work at every prompt; returns True when the input was a mode command.
    def _mode_command(self, text: str) -> bool:
        cmd = text.strip().lower()
        if cmd == "/y":
            self.mode = "yolo"
            self.display.info("Mode: yolo (commands run without asking). /c to confirm again.")
            return True
        if cmd == "/c":
            self.mode = "confirm"
            self.display.info("Mode: confirm (each command waits for Enter). /y to stop asking.")
            return True
        if cmd in ("/h", "/help", "/?"):
            self.display.info(self._help())
            return True
        if cmd.split()[:1] == ["/undo"]:
            self._undo(cmd)
            return True
        if cmd.split()[:1] == ["/compact"]:
            self._compact(text.strip()[len("/compact"):].strip() or None)
            return True
        if cmd == "/usage":
            self.display.usage_report(self.session_usage(), self.context())
            return True
        if cmd in ("/good", "/bad") and self.rate is not None:
            self.display.info(self.rate(cmd))
            return True
        if cmd.startswith("/") and " " not in cmd and cmd not in QUIT_WORDS:
            # A lone `/word` is a mistyped command, not feedback meant for the model.
            self.display.warn(f"Unknown command {cmd}. {self._help()}")
            return True
        return False

    def _undo(self, cmd: str) -> None:
        if self.undo is None:
            self.display.warn("Undo is off: start tmax run with --undo-steps N to undo the last N commands.")
            return
        try:
            note = self.undo.undo(cmd)
        except ValueError as e:
            self.display.warn(str(e))
            return
        self.undo_note = f"{self.undo_note}\n{note}" if self.undo_note else note
        self.display.info(note)

    def _compact(self, focus: str | None) -> None:
        if self.compact is None:
            self.display.warn("This session cannot compact.")
        elif self.compact(focus) is None:
            self.display.info("Compaction requested: it runs before the next model call.")

    def on_compaction_start(self, reason: str, context_tokens: int) -> None:
        from tmax.cli.ui import fmt_tokens

        self.display.stop_spinner()
        use = self.context()
        why = {"auto": "the next request would pass the compaction threshold", "manual": "/compact",
               "overflow": "the server said the request is over its window"}[reason]
        of = f" of {fmt_tokens(use.window)}" if use is not None else ""
        self.display.warn(f"Compacting the context ({fmt_tokens(context_tokens)}{of} tokens; {why}).")
        self.display.start_spinner(f"Compacting the context ({fmt_tokens(context_tokens)} tokens): the model writes "
                                   "a summary… (Ctrl-C cancels it)")

    def on_compaction(self, record: CompactionRecord) -> None:
        self.display.stop_spinner()
        self.display.compaction(record)

    def on_output_clipped(self, step: int, clip: Clip) -> None:
        self.live = None
        self.display.stop_spinner()
        self.display.warn(f"The output of step {step} ({clip.chars:,} characters) is more than fits the context "
                          f"window: the model gets its head and tail ({clip.kept:,} characters); the whole output: "
                          f"{clip.file}")

    def _help(self) -> str:
        from tmax.cli.ui import HELP

        return f"{HELP}\nMode now: {self.mode}."

    def on_step_start(self, step: int) -> None:
        self.display.stop_spinner()
        self.display.step_header(step, self.max_steps)
        self.display.start_spinner(WAITING_TEXT)

    def on_model_turn(self, step: int, turn: ModelTurn, command: str | None) -> None:
        self.display.stop_spinner()
        self.display.thought(turn.message.get("content"))
        if command is not None:
            self.display.command(command)
        self.display.usage(turn.usage, self.session_usage(), turn.latency_s, self.context())

    def approve(self, step: int, command: str) -> str | None:
        while self.mode == "confirm":
            try:
                answer = self.prompter.ask("Enter: run · text: reject with feedback · /y yolo · /h help > ")
            except EOFError:
                self.stopping.set()
                raise KeyboardInterrupt from None
            except KeyboardInterrupt:
                guidance = self.on_interrupt()
                if guidance is None:
                    self.stopping.set()
                    raise
                return guidance
            if self._mode_command(answer):
                if self.undo_note:  # the proposed command was made for the files as they were
                    answer, self.undo_note = self.undo_note, None
                    return answer
                continue
            if answer.strip() == "":
                break
            if answer.strip() in QUIT_WORDS:
                self.stopping.set()
                raise KeyboardInterrupt
            self.display.feedback(answer, "rejected; sent to the model")
            return answer
        if self.undo is not None:
            self.undo.before(command)
        self.live = self.display.start_live(RUNNING_TEXT)
        return None

    def on_command_output(self, text: str) -> None:
        if self.live is not None:
            self.live.add(text)

    def on_observation(self, step: int, result: CommandResult, observation: str) -> None:
        self.live = None
        self.display.stop_spinner()
        kept = keep_long_output(self.run_dir, step, result, self.output_limit)
        self.display.output(result.output, result.exit_code, result.duration_s, result.timed_out, result.note,
                            kept=str(kept) if kept else None)

    def on_format_error(self, step: int, feedback: str, reason: str | None = None) -> None:
        self.display.stop_spinner()
        self.display.format_error(feedback if reason is None else f"{feedback}\n\n(why: {reason})")

    def on_retry(self, attempt: int, error: Exception, delay_s: float) -> None:
        self.display.stop_spinner()
        self.display.warn(f"Model call failed ({error}); retry {attempt} in {delay_s:g}s.")
        self.display.start_spinner(WAITING_TEXT)

    def on_interrupt(self) -> str | None:
        self.display.stop_spinner()
        if self.stopping.is_set():
            return None
        self.display.warn("Interrupted. The shell is still there.")
        while True:
            try:
                answer = self.prompter.ask("Guidance for the agent (Enter or /q to quit) > ")
            except (EOFError, KeyboardInterrupt):
                self.stopping.set()
                return None
            if self._mode_command(answer):
                if self.undo_note:
                    answer, self.undo_note = self.undo_note, None
                    return answer
                continue
            if answer.strip() in ("", *QUIT_WORDS):
                self.stopping.set()
                return None
            return answer

    def ask_follow_up(self) -> str | None:
        while True:
            try:
                answer = self.prompter.ask("Follow-up task in the same shell (Enter to quit) > ")
            except (EOFError, KeyboardInterrupt):
                return None
            if self._mode_command(answer):
                continue
            if answer.strip() in ("", *QUIT_WORDS):
                return None
            if self.undo_note:
                answer, self.undo_note = f"{self.undo_note}\n\n{answer}", None
            return answer

