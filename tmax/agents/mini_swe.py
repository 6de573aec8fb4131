"""The mini-swe-agent style harness, from its public description (default config).

* No tools: the action is the one fenced ```bash block in the message content; zero or
  several blocks are a format error.
* Every command runs as a fresh process (`bash -c`): `cd` and `export` do not persist,
  and the prompt says so. It is launched from the sandbox's shell, whose own state never
  changes, so Ctrl-C, the kill of a second Ctrl-C and timeouts reach it as in the tmax
  harness; its output goes through a pipe with stderr merged, as in mini-swe-agent.
* The observation is `<returncode>` + `<output>` (head/tail with a warning when long);
  a timed-out command gets its own message.
* The episode is submitted when the first line of a command's output is the submit marker
  (the same marker as Vanillux2, so `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from tmax.agents.observation import ObservationLimits, strip_compose_noise
from tmax.agents.parsing import THINK_CLOSE, Action
from tmax.agents.prompts import SUBMIT_COMMAND, SUBMIT_MARKER, render
from tmax.sandbox.base import CommandResult, Sandbox

_BLOCK_RE = re.compile(r"```bash\s*\n(.*?)\n```", re.S)

SYSTEM_TEMPLATE = """\
You are a helpful assistant that can interact with a computer.

Your response must contain exactly ONE bash code block with ONE command (or commands \
connected with && or ||). Include a THOUGHT section before your command where you explain \
your reasoning.

Format your response like this:

THOUGHT: Your reasoning and analysis here. Explain why you want to run this command.

```bash
your_command_here
```

Responses without exactly one bash code block are rejected."""

INSTANCE_TEMPLATE = """\
Please solve this task:

{{task}}

You can run bash commands and edit files to do so.

## Recommended workflow

1. Look around: find the relevant files and understand what the task needs
2. Make the changes, one step at a time
3. Check the result, including edge cases
4. When you are done, submit by running exactly this command on its own:
   `{{submit}}`
   You cannot continue working after you submit.

## Rules

1. Every response has a THOUGHT and exactly ONE ```bash block
2. Each command runs in a new subshell: directory and environment variable changes do not \
persist. Prefix commands with `cd /path &&` where needed, or write state to files.
3. Commands that may take long should be wrapped in `timeout`
4. Do not use interactive programs (editors, pagers, prompts)

Create a file with a here-document, e.g.

```bash
cat <<'EOF' > script.py
print("hello")
EOF
```"""

FORMAT_ERROR_TEMPLATE = """\
Please always provide EXACTLY ONE action in triple backticks ({{error}}).

Reply with a THOUGHT section followed by exactly one ```bash block. To finish, run \
`{{submit}}` on its own."""

TIMEOUT_TEMPLATE = """\
The last command <command>{{command}}</command> timed out and has been killed.
The output of the command was:
<output>
{{output}}
</output>
Please try another command and make sure to avoid those requiring interactive input."""

LONG_OUTPUT_WARNING = (
    "The output of your last command was too long.\n"
    "Please try a different command that produces less output.\n"
    "If you're looking at a file you can try use head, tail or sed to view a smaller number of lines selectively.\n"
    "If you're using grep or find and it produced too much output, you can use a more selective search pattern."
)


def find_actions(content: str) -> list[str]:
    """The fenced bash blocks after any thinking."""
    cut = content.rfind(THINK_CLOSE)
    text = content if cut < 0 else content[cut + len(THINK_CLOSE) :]
    return [m.group(1).strip() for m in _BLOCK_RE.finditer(text)]


def _output(result: CommandResult) -> str:
    out = result.output or ""
    if result.stderr:
        out = f"{out}\n{result.stderr}" if out else result.stderr
    return strip_compose_noise(out)


class MiniSweHarness:
    name = "mini-swe"
    tools: list[dict[str, Any]] = []

    def __init__(self, workdir: str | None = None) -> None:
        self.workdir = workdir

    def initial_messages(self, task: str) -> list[dict[str, Any]]:
        user = render(INSTANCE_TEMPLATE, task=task.strip(), submit=SUBMIT_COMMAND)
        return [{"role": "system", "content": SYSTEM_TEMPLATE}, {"role": "user", "content": user}]

    def parse(self, message: dict[str, Any]) -> Action:
        actions = find_actions(message.get("content") or "")
        if len(actions) != 1:
            return Action(error=f"found {len(actions)} bash blocks")
        if not actions[0]:
            return Action(error="the bash block is empty")
        return Action(command=actions[0], submit=False)

    def format_error(self, action: Action) -> str:
        return render(FORMAT_ERROR_TEMPLATE, error=action.error or "no bash block", submit=SUBMIT_COMMAND)

    def execute(self, sandbox: Sandbox, action: Action, timeout: float) -> CommandResult:
        assert action.command is not None
        cd = f"cd {shlex.quote(self.workdir)} && " if self.workdir else ""
        line = f"({cd}exec bash -c {shlex.quote(action.command)}) </dev/null 2>&1 | cat; (exit ${{PIPESTATUS[0]}})"
        return sandbox.run(line, timeout=timeout)

    def interrupt(self, sandbox: Sandbox, force: bool = False) -> None:
        sandbox.interrupt(force=force)

    def observe(self, action: Action, result: CommandResult, limits: ObservationLimits) -> tuple[str, bool]:
        output = _output(result)
        if result.timed_out:
            return render(TIMEOUT_TEMPLATE, command=action.command or "", output=output[-limits.tail_chars :]), False
        lines = output.lstrip().splitlines()
        if lines and lines[0].strip() == SUBMIT_MARKER:
            return output, True
        if len(output) + result.dropped_chars <= limits.max_chars:
            return f"<returncode>{result.exit_code}</returncode>\n<output>\n{output}</output>", False
        elided = len(output) + result.dropped_chars - limits.head_chars - limits.tail_chars
        return (
            f"<returncode>{result.exit_code}</returncode>\n<warning>\n{LONG_OUTPUT_WARNING}\n</warning>\n"
            f"<output_head>\n{output[: limits.head_chars]}\n</output_head>\n"
            f"<elided_chars>\n{elided} characters elided\n</elided_chars>\n"
            f"<output_tail>\n{output[-limits.tail_chars :]}\n</output_tail>"
        ), False

    def close(self) -> None:
        pass

    def demo_turns(self, thought: str, command: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": f"{thought}\n\n```bash\n{command}\n```"}]
