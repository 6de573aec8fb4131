"""The Terminus-2 style harness, from its public description.

* The model drives a tmux session inside the sandbox (`agents.tmux`), by keystrokes.
* It answers with one JSON object: `analysis`, `plan`, `commands` (a list of
  `{keystrokes, duration}`; duration in seconds, default 1, at most 60) and `task_complete`.
* It sees the terminal: the new output since its last look, or the whole screen.
* `task_complete: true` once asks for a confirmation; a second one in a row ends the episode.
* Ctrl-C (`interrupt`) is typed into the terminal; a second one kills its foreground job.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from tmax.agents.observation import ObservationLimits, truncate
from tmax.agents.parsing import THINK_CLOSE, Action
from tmax.agents.prompts import SUBMIT_MARKER, render
from tmax.agents.tmux import TmuxSession
from tmax.sandbox.base import CommandResult, Sandbox
from tmax.common.waiting import wait_until

MAX_DURATION_S = 60.0
DEFAULT_DURATION_S = 1.0
INTERRUPT_GRACE_S = 5.0  # how long a Ctrl-C may take to end the job in the terminal

PROMPT_TEMPLATE = """\
You are an AI assistant solving command-line tasks in a Linux environment. You drive a \
terminal (a tmux session) by sending keystrokes, and you see what the terminal shows.

Task:
{{task}}

Answer with ONE JSON object and nothing else, with these fields:

{
  "analysis": "What the terminal shows and what it means for the task so far.",
  "plan": "What you will do next, and why.",
  "commands": [
    {"keystrokes": "ls -la\\n", "duration": 0.1},
    {"keystrokes": "cd project\\n", "duration": 0.1}
  ],
  "task_complete": false
}

- "keystrokes" are sent to the terminal exactly as written: end a command with \\n to run \
it. Key names such as C-c (interrupt) or C-d are sent as keys when they are the whole string.
- "duration" is how many seconds to wait for the command before looking at the terminal \
(default 1, at most 60). Use short waits (0.1) for quick commands and poll with empty \
keystrokes for long ones rather than waiting long.
- "commands" may be empty, e.g. to wait and look again.
- Set "task_complete" to true when the task is done; you will be asked to confirm.
- Do not use interactive commands you cannot leave; the terminal is only yours."""

CONFIRM_TEXT = (
    "Are you sure you want to mark the task as complete? Your solution will be graded and you "
    'will not be able to change it. If so, answer with "task_complete": true again.'
)

PARSE_ERROR_TEMPLATE = """\
Your previous response had parsing errors:
ERROR: {{error}}

Please fix these issues and answer with one proper JSON object."""


@dataclass(frozen=True)
class KeystrokeAction(Action):
    commands: tuple[tuple[str, float], ...] = ()
    task_complete: bool = False


def _json_object(content: str) -> Any:
    cut = content.rfind(THINK_CLOSE)
    text = content if cut < 0 else content[cut + len(THINK_CLOSE) :]
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object found in the response")
    try:
        return json.loads(text[start : end + 1])
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from None


def _commands(raw: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(raw, list):
        raise ValueError('"commands" must be a list')
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("keystrokes"), str):
            raise ValueError(f'command {i} needs a string "keystrokes"')
        duration = item.get("duration", DEFAULT_DURATION_S)
        if not isinstance(duration, (int, float)) or isinstance(duration, bool) or duration < 0:
            raise ValueError(f'command {i}: "duration" must be a non-negative number')
        out.append((item["keystrokes"], min(float(duration), MAX_DURATION_S)))
    return tuple(out)


def parse_keystrokes(content: str) -> KeystrokeAction:
    try:
        obj = _json_object(content)
        if not isinstance(obj, dict):
            raise ValueError("the response is not a JSON object")
        missing = [k for k in ("analysis", "plan", "commands") if k not in obj]
        if missing:
            raise ValueError(f"missing required fields: {', '.join(missing)}")
        commands = _commands(obj["commands"])
    except ValueError as e:
        return KeystrokeAction(error=str(e))
    done = obj.get("task_complete", False)
    done = done if isinstance(done, bool) else str(done).lower() == "true"
    shown = "".join(keys for keys, _ in commands)
    return KeystrokeAction(command=shown, commands=commands, task_complete=done)


class TerminusHarness:
    name = "terminus-2"
    tools: list[dict[str, Any]] = []

    def __init__(self, workdir: str | None = None) -> None:
        self.workdir = workdir
        self._session: TmuxSession | None = None
        self._last_history = ""
        self._pending_completion = False
        self._stop = threading.Event()  # set by `interrupt`: stop typing and waiting

    def initial_messages(self, task: str) -> list[dict[str, Any]]:
        self._pending_completion = False
        return [{"role": "user", "content": render(PROMPT_TEMPLATE, task=task.strip())}]

    def parse(self, message: dict[str, Any]) -> Action:
        return parse_keystrokes(message.get("content") or "")

    def format_error(self, action: Action) -> str:
        self._pending_completion = False
        return render(PARSE_ERROR_TEMPLATE, error=action.error or "no JSON object")

    def execute(self, sandbox: Sandbox, action: Action, timeout: float) -> CommandResult:
        assert isinstance(action, KeystrokeAction)
        t0 = time.monotonic()
        self._stop.clear()
        if self._session is None or self._session.sandbox is not sandbox:
            self._session = TmuxSession(sandbox, self.workdir)
            self._session.start()
        for keys, duration in action.commands:
            if self._stop.is_set():
                break
            self._session.send_keys(keys)
            left = timeout - (time.monotonic() - t0)
            self._stop.wait(max(0.0, min(duration, left)))
        interrupted = self._stop.is_set()
        if interrupted:
            self._settle(t0 + timeout)
        return CommandResult(output=self._view(), exit_code=130 if interrupted else 0,
                             duration_s=time.monotonic() - t0)

    def _settle(self, deadline: float) -> None:
        """After a Ctrl-C, wait (a few seconds at most) for the job in the terminal to end,
        so that a second Ctrl-C still finds one that ignored the first."""
        assert self._session is not None
        session = self._session
        wait_until(lambda: not session.foreground_busy(), min(deadline - time.monotonic(), INTERRUPT_GRACE_S), 0.2)

    def interrupt(self, sandbox: Sandbox, force: bool = False) -> None:
        """Ctrl-C typed into the terminal and no more keys or waiting; `force` (the Ctrl-C
        was ignored) also kills what runs in the terminal's foreground."""
        self._stop.set()
        session = self._session
        if session is None or not session.started:
            return
        session.send_keys("C-c")
        if force:
            session.kill_foreground()

    def _view(self) -> str:
        """New terminal output since the last look when that is well defined, else the screen."""
        assert self._session is not None
        history = self._session.capture(history=True).rstrip()
        previous, self._last_history = self._last_history, history
        if previous and history.startswith(previous):
            new = history[len(previous) :].strip("\n")
            return "New Terminal Output:\n" + (new or "(no new output)")
        return "Current Terminal Screen:\n" + self._session.capture().rstrip()

    def observe(self, action: Action, result: CommandResult, limits: ObservationLimits) -> tuple[str, bool]:
        assert isinstance(action, KeystrokeAction)
        text = truncate(result.output, limits)
        if not action.task_complete:
            self._pending_completion = False
            return text, False
        if self._pending_completion:
            return text, True
        self._pending_completion = True
        return f"{text}\n\n{CONFIRM_TEXT}", False

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def demo_turns(self, thought: str, command: str) -> list[dict[str, Any]]:
        """A command is typed and run (Enter) with the default wait; the submit command
        becomes `task_complete` (no keystrokes), sent twice: the second one confirms."""
        analysis = thought.removeprefix("THOUGHT:").strip()
        if SUBMIT_MARKER in command:
            done = {"analysis": analysis, "plan": "The task is complete.", "commands": [], "task_complete": True}
            return [{"role": "assistant", "content": json.dumps(done, ensure_ascii=False)} for _ in range(2)]
        keys = [{"keystrokes": command + "\n", "duration": DEFAULT_DURATION_S}]
        step = {"analysis": analysis, "plan": "Run the command.", "commands": keys, "task_complete": False}
        return [{"role": "assistant", "content": json.dumps(step, ensure_ascii=False)}]
