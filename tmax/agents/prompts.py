"""The Vanillux2 prompt set, in our own words.

Structure and rules follow the Tmax evaluation harness (itself derived from mini-swe-agent):
a short, task-independent system prompt; one user message that wraps the task with a
recommended workflow, the rules, and command examples. Lengths are kept close to the
original (system 464 chars, instance 1,981 chars with the placeholder) so the context
budget a model sees is comparable.

The instance template uses a plain `{{task}}` placeholder replaced by string substitution,
not Jinja, so braces in a task text can never break rendering.
"""

from __future__ import annotations

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SUBMIT_COMMAND = f"echo {SUBMIT_MARKER}"

SYSTEM_TEMPLATE = """\
You are a helpful assistant that can interact with a computer through a terminal.

Each of your responses must contain a THOUGHT section that explains your reasoning, followed \
by a call to the `bash` tool with exactly ONE bash command. Commands joined with && or || \
count as one action.

Your response will be rejected if it does not call any tool, if it calls a tool other than \
`bash`, or if the THOUGHT section is missing. Keep THOUGHTs short and to the point."""

INSTANCE_TEMPLATE = """\
Please solve this task:

{{task}}

You can run bash commands through the `bash` tool and edit files with tools such as `sed` \
or `cat > file << 'EOF'`, or any other command-line method you prefer.

## Recommended Workflow

1. Explore the codebase or the environment: find the relevant files and understand what the task needs
2. If it applies, write a script that reproduces the problem
3. Make the changes that solve the task, one step at a time
4. Check your solution by running your script (or your checks) again
5. Try edge cases to make sure the solution is robust and complete
6. Submit by issuing exactly `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, on its own and not \
combined with any other command. After you submit you cannot do any more work.

## Important Rules

1. Every response must contain exactly one `bash` tool call
2. The shell is persistent: cd and export DO persist across calls, and so do shell variables, \
functions and background jobs. Unlike agents that start a fresh subshell for every command, \
treat this as one long-running login shell.
3. Wrap commands that may run for a long time in `timeout`, e.g. `timeout 30 make test`
4. Do not run interactive commands (editors, pagers, prompts). Use non-interactive flags or \
pipe the answers in with `yes` / `no` (for example `yes | apt-get install ...`)
5. Long output may be truncated; look at the part you need with head, tail, grep or `sed -n`

## Useful command examples

### Create a new file:

```bash
cat <<'EOF' > newfile.py
import numpy as np
greeting = "hello"
print(greeting)
EOF
```

### Edit files with sed:

```bash
# Replace every occurrence
sed -i 's/old_string/new_string/g' filename.py

# Replace the occurrence on line 1 only
sed -i '1s/old_string/new_string/' filename.py

# Replace occurrences on lines 1 to 10
sed -i '1,10s/old_string/new_string/g' filename.py
```

### View part of a file:

```bash
# Show lines 10 to 20 with line numbers
nl -ba filename.py | sed -n '10,20p'
```"""

FORMAT_ERROR_TEXT = "Your last response did not include a valid `bash` tool call."

FORMAT_ERROR_TEMPLATE = """\
Format error: {{error}}

Please always reply with a THOUGHT followed by EXACTLY ONE call to the `bash` tool.
To end the task, call the `bash` tool with `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` and nothing else in that command."""

TOO_LONG_HINT = (
    "The output of your last command was too long to show in full. Try a different command "
    "that prints less. To read a file, look at a few lines at a time with head, tail or "
    "sed -n. If grep or find printed too much, make the pattern more selective or narrow the "
    "directories you search. If you really need something from the full output, redirect "
    "the output to a file first and then search inside that file with grep, or look at "
    "slices of it with sed -n."
)

REJECTED_TOOL_TEXT = "The user rejected this command; it was not run."


def render(template: str, **values: str) -> str:
    """Plain `{{name}}` substitution (no Jinja: task texts may contain braces)."""
    out = template
    for key, value in values.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def system_message() -> dict[str, str]:
    return {"role": "system", "content": SYSTEM_TEMPLATE}


def instance_message(task: str) -> dict[str, str]:
    return {"role": "user", "content": render(INSTANCE_TEMPLATE, task=task.strip())}


def format_error_feedback(error: str = FORMAT_ERROR_TEXT) -> str:
    return render(FORMAT_ERROR_TEMPLATE, error=error)
