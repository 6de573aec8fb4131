"""A harness is what differs between agent styles, around one loop (`agents.loop.Agent`).

The loop skeleton (query the model, count steps and format errors, retry model errors,
record, stop at a budget) is shared; a harness supplies the small protocol around it:

* `initial_messages`  the prompt ([system, user(task)]) and `tools` (may be empty);
* `parse`             an assistant message -> the one `Action` to run, or a format error;
* `format_error`      the feedback for a response without a usable action;
* `execute`           run the action in the sandbox -> a `CommandResult`;
* `observe`           the result -> (observation text, whether the episode is finished);
* `interrupt`         Ctrl-C for the action in flight (`force`: kill it), from another thread;
* `close`             release what it started in the sandbox;
* `demo_turns`        a scripted (THOUGHT, command) step written as this harness's model
                      would write it (SFT demonstrations play these through the loop).

Three harnesses exist (`agents.harnesses`): `tmax` (Vanillux2, below), `mini-swe`
(`agents.mini_swe`) and `terminus-2` (`agents.terminus`). Token policies see only
messages, so token-exact training works for every harness alike.
"""

from __future__ import annotations

from typing import Any, Protocol

from tmax.agents.observation import ObservationLimits, format_observation
from tmax.agents.parsing import Action, parse_action
from tmax.agents.prompts import SUBMIT_MARKER, format_error_feedback, instance_message, system_message
from tmax.agents.tools import BASH_TOOL_NAME, TOOLS
from tmax.sandbox.base import CommandResult, Sandbox


class Harness(Protocol):
    name: str
    tools: list[dict[str, Any]]

    def initial_messages(self, task: str) -> list[dict[str, Any]]: ...

    def parse(self, message: dict[str, Any]) -> Action: ...

    def format_error(self, action: Action) -> str: ...

    def execute(self, sandbox: Sandbox, action: Action, timeout: float) -> CommandResult: ...

    def observe(self, action: Action, result: CommandResult, limits: ObservationLimits) -> tuple[str, bool]: ...

    def interrupt(self, sandbox: Sandbox, force: bool = False) -> None:
        """Stop the action `execute` is running (called from another thread); `force` when
        an earlier interrupt was ignored."""
        ...

    def close(self) -> None:
        """Release what the harness started in the sandbox (e.g. a tmux server)."""
        ...

    def demo_turns(self, thought: str, command: str) -> list[dict[str, Any]]:
        """The assistant message(s) that play one scripted step: `parse` of each gives the
        step's action back. The submit command (`SUBMIT_COMMAND`) ends the episode, so a
        harness that asks to confirm a submission answers the confirmation here too."""
        ...


class TmaxHarness:
    """Vanillux2: one native `bash` tool call per turn, a persistent shell, the submit marker."""

    name = "tmax"
    tools = TOOLS

    def initial_messages(self, task: str) -> list[dict[str, Any]]:
        return [system_message(), instance_message(task)]

    def parse(self, message: dict[str, Any]) -> Action:
        return parse_action(message)

    def format_error(self, action: Action) -> str:
        return format_error_feedback()

    def execute(self, sandbox: Sandbox, action: Action, timeout: float) -> CommandResult:
        assert action.command is not None
        return sandbox.run(action.command, timeout=timeout)

    def observe(self, action: Action, result: CommandResult, limits: ObservationLimits) -> tuple[str, bool]:
        observation = format_observation(result, limits)
        return observation, action.submit or SUBMIT_MARKER in observation

    def interrupt(self, sandbox: Sandbox, force: bool = False) -> None:
        sandbox.interrupt(force=force)

    def close(self) -> None:
        pass

    def demo_turns(self, thought: str, command: str) -> list[dict[str, Any]]:
        call = {"type": "function", "function": {"name": BASH_TOOL_NAME, "arguments": {"command": command}}}
        return [{"role": "assistant", "content": thought, "tool_calls": [call]}]
