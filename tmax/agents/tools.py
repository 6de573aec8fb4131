"""The one tool the agent has: `bash(command)`.

The description is the persistent-shell wording that was in effect for the Tmax evals and
RL runs; tmax's shell really is persistent, so the wording is also true here.
"""

from __future__ import annotations

from typing import Any

BASH_TOOL_NAME = "bash"

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": BASH_TOOL_NAME,
        "description": (
            "Execute a bash command in a persistent shell. Working directory and "
            "environment variables are preserved between calls."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to execute."},
            },
            "required": ["command"],
        },
    },
}

TOOLS: list[dict[str, Any]] = [BASH_TOOL]
