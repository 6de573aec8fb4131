"""Vanillux2 prompt structure: the system prompt, the instance template, the format-error
feedback and the bash tool schema."""

from tmax.agents.prompts import (
    FORMAT_ERROR_TEMPLATE,
    INSTANCE_TEMPLATE,
    SUBMIT_MARKER,
    SYSTEM_TEMPLATE,
    format_error_feedback,
    instance_message,
    system_message,
)
from tmax.agents.tools import BASH_TOOL, TOOLS


def close_to(n, ref, tolerance=0.05):
    return abs(n - ref) <= ref * tolerance


def test_system_prompt_rules_and_length():
    s = SYSTEM_TEMPLATE
    assert close_to(len(s), 464)
    assert "THOUGHT" in s and "`bash`" in s and "exactly ONE" in s
    assert "&&" in s and "||" in s
    assert "rejected" in s
    assert "{{" not in s  # the task is never in the system prompt
    assert system_message() == {"role": "system", "content": s}


def test_instance_template_structure():
    t = INSTANCE_TEMPLATE
    assert close_to(len(t), 1981)
    assert t.startswith("Please solve this task:\n\n{{task}}\n\n")
    assert t.count("{{task}}") == 1
    sections = ["## Recommended Workflow", "## Important Rules", "## Useful command examples"]
    positions = [t.index(h) for h in sections]
    assert positions == sorted(positions)
    workflow = t[positions[0] : positions[1]]
    assert [f"{i}. " in workflow for i in range(1, 7)] == [True] * 6
    assert f"`echo {SUBMIT_MARKER}`" in workflow and "not" in workflow
    rules = t[positions[1] : positions[2]]
    assert [f"{i}. " in rules for i in range(1, 6)] == [True] * 5
    assert "cd and export DO persist" in rules
    assert "timeout 30" in rules and "interactive" in rules and "truncated" in rules
    examples = t[positions[2] :]
    assert "cat <<'EOF' > newfile.py" in examples
    for sed in ("sed -i 's/old_string/new_string/g'", "sed -i '1s/old_string/new_string/'", "sed -i '1,10s/old_string/new_string/g'"):
        assert sed in examples
    assert "nl -ba filename.py | sed -n '10,20p'" in examples


def test_instance_rendering_is_plain_substitution_of_the_stripped_task():
    task = "  Fix {{x}} and {braces} in /app.\n\n"
    msg = instance_message(task)
    assert msg["role"] == "user"
    assert msg["content"].startswith("Please solve this task:\n\nFix {{x}} and {braces} in /app.\n\nYou can run")
    assert len(msg["content"]) == len(INSTANCE_TEMPLATE) - len("{{task}}") + len(task.strip())


def test_format_error_feedback():
    fb = format_error_feedback()
    assert fb.startswith("Format error: Your last response did not include a valid `bash` tool call.\n\n")
    assert "EXACTLY ONE" in fb and f"echo {SUBMIT_MARKER}" in fb
    assert close_to(len(FORMAT_ERROR_TEMPLATE), 242, 0.08)


def test_bash_tool_schema():
    assert TOOLS == [BASH_TOOL]
    fn = BASH_TOOL["function"]
    assert BASH_TOOL["type"] == "function" and fn["name"] == "bash"
    assert fn["description"] == (
        "Execute a bash command in a persistent shell. Working directory and environment variables are preserved between calls."
    )
    assert fn["parameters"] == {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The bash command to execute."}},
        "required": ["command"],
    }
