"""The four generation stages' prompts and the parsers of their answers.

Stage 1 (template) answers with `<task>` and `<truth>` blocks; stages 2 and 3 (initial-
and final-state tests) with one fenced python block; stage 4 (environment) with a
`<dockerfile>` block, any number of `<file path="...">` blocks (the build context) and a
`<solve>` block (the reference solution, a bash script). A retry of stage 3 or 4 gets the
gate's error text under "Previous failures".
"""

from __future__ import annotations

import re

from tmax.tasks.corpus.axes import AxesConfig, TaskAxes, load_axes
from tmax.tasks.corpus.package import AGENT_USER, HOME
from tmax.tasks.dockerfile import instructions
from tmax.tasks.task_images import PYTHON_BASE_TAG

TEMPERATURE = {"template": 1.0, "initial": 0.6, "final": 0.6, "environment": 0.6}
FEEDBACK_CHARS = 500


class ParseError(ValueError):
    """The model's answer does not have the blocks the stage asked for."""


_UNIVERSAL = f"""## Universal task requirements
- Challenging, but easy to verify automatically; self-contained; realistic.
- The agent works in a Linux terminal, in its home {HOME}, as the normal user `{AGENT_USER}` (not
  root) unless the task says otherwise. Use full absolute paths. No tasks about the latest information.
- Never leak the solution or the verifier into the task text."""


def template_messages(axes: TaskAxes, feedback: str | None = None, config: AxesConfig | None = None) -> list[dict]:
    config = config or load_axes()
    system = (f"You are an expert at creating {axes.domain.replace('_', ' ')} tasks for AI agent training.\n\n"
              f"{_UNIVERSAL}\n\n## Response format\n"
              "<task>the detailed request, as a user would write it: exact paths and output formats, "
              "never the commands</task>\n<truth>privileged ground truth: the pre-existing state, the expected "
              "outputs, and runnable snippets that recompute them</truth>")
    lines = ["# Task Generation Request", f"Category: {axes.skill_type}", "",
             f"## Primary Language\n{axes.language}", "",
             "## Primitive Skills (Building Blocks)", *[f"- {s}" for s in axes.primitive_skills], "",
             f"## Task Complexity\n{config.task_complexity.get(axes.task_complexity, axes.task_complexity)}", "",
             f"## Command Complexity\n{config.command_complexity.get(axes.command_complexity, axes.command_complexity)}",
             "", f"## Scenario\n{axes.scenario}"]
    if axes.anchor:
        lines += ["", f"## Scenario Anchor (use as inspiration, not literally)\n{axes.anchor}"]
    if axes.corpus_kind != "legacy":
        lines += ["", "## v2 Axes", f"- verifier kind: {axes.verifier_kind}", f"- fixture kind: {axes.fixture_kind}",
                  "", verifier_fragment(axes.verifier_kind)]
    lines += ["", "## Instructions", "1. Write a novel task that combines 3-5 of the skills above.",
              "2. Make it hard to solve but easy to verify, unambiguous and realistic end to end.",
              "3. Be specific about the output format; write it as a user would ask."]
    if feedback:
        lines += ["", f"## Previous failures\n{feedback}"]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(lines)}]


# What the final test of each verifier kind must do, and the imports it may use beyond
# the stdlib and pytest. An unknown kind (a user's axes file) gets the exact_text rules.
VERIFIERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "exact_text": ("check the final state against the truth; derive or recompute expected values; prefer "
                   "invariants over brittle whole-file equality", ()),
    "metric_threshold": ("implement the metric the truth defines and assert it against its threshold; put the "
                         "measured value and the threshold in the failure message",
                         ("numpy", "scipy", "sklearn", "PIL", "imageio", "torch", "torchvision", "Bio", "pandas",
                          "matplotlib")),
    "adversarial_corpus": ("require every evil/ file to be rejected or sanitised and every clean/ file preserved, "
                           "and report 'X of Y evil bypassed' and 'Z of W clean modified'", ("bs4", "lxml")),
    "fuzz_equivalence": ("run the oracle and the agent's program on N seeded random inputs and require "
                         "bit-exact agreement; on a mismatch show the input and both outputs", ("numpy",)),
    "multi_protocol": ("connect to the declared host:port and drive real protocol requests", ("requests",)),
}


def verifier_fragment(kind: str) -> str:
    rule, imports = VERIFIERS.get(kind, VERIFIERS["exact_text"])
    allowed = ", ".join(imports) if imports else "none"
    return f"# Verifier kind: {kind}\nThe test must {rule}. Imports allowed beyond stdlib and pytest: {allowed}."


def _task_block(task: str, truth: str) -> str:
    return f"## Task\n{task}\n\n## Truth (privileged)\n{truth}"


def initial_test_messages(task: str, truth: str) -> list[dict]:
    system = ("You are a senior Python engineer. Write ONE pytest file that validates the operating-system "
              f"state BEFORE the task is done: stdlib and pytest only, full paths, home {HOME}; never test the "
              "task's output files. Answer with one ```python fenced block.")
    return [{"role": "system", "content": system}, {"role": "user", "content": _task_block(task, truth)}]


def final_test_messages(task: str, truth: str, initial_test: str, feedback: str | None = None,
                        verifier_kind: str = "exact_text") -> list[dict]:
    system = ("You are a senior Python engineer. Write ONE pytest file that validates the FINAL state after the "
              "task, using the privileged truth: clear failure messages, absolute paths; recompute expected "
              "values rather than pasting constants; use the strongest fair assertion. The file must FAIL on "
              "the untouched initial state. Answer with one ```python fenced block.\n\n"
              + verifier_fragment(verifier_kind))
    user = f"{_task_block(task, truth)}\n\n## Initial-state test\n```python\n{initial_test}\n```"
    if feedback:
        user += f"\n\n## Previous failures\n{feedback}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def environment_messages(domain: str, task: str, truth: str, initial_test: str, final_test: str,
                         feedback: str | None = None) -> list[dict]:
    system = ("You write the environment of a terminal task as a Dockerfile plus its build-context files, and a "
              f"reference solution. The Dockerfile must start FROM {PYTHON_BASE_TAG} (Debian bookworm with "
              "python3 and pip), create the "
              "pre-existing state (files, data, packages; prefer COPY of context files), then create the agent's "
              f"user with `RUN useradd -m {AGENT_USER} && chmod -R 777 {HOME}` (so it can write all of its "
              "home; anything else it must change must be writable by it too), and end with WORKDIR "
              f"{HOME}. Keep root as the image's USER (no USER line): the agent runs as `{AGENT_USER}`, the "
              "tests as root. Never create "
              "the task's outputs. The tests run with the base's python3 (pytest when it is installed). "
              f"The solution is a bash script that `{AGENT_USER}` runs in {HOME} to do the task "
              "from the initial state. Answer with:\n<dockerfile>...</dockerfile>\n"
              "<file path=\"relative/path\">contents</file> (zero or more)\n<solve>#!/bin/bash ...</solve>")
    user = (f"Domain: {domain}\n\n{_task_block(task, truth)}\n\n## Initial-state test\n```python\n{initial_test}\n```"
            f"\n\n## Final-state test\n```python\n{final_test}\n```\n\n## Previous failures\n{feedback or 'None yet'}")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _block(text: str, tag: str) -> str | None:
    m = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    return m.group(1).strip("\n") if m and m.group(1).strip() else None


def parse_template(text: str) -> tuple[str, str]:
    task, truth = _block(text, "task"), _block(text, "truth")
    if not task or not truth:
        raise ParseError("the answer needs non-empty <task>...</task> and <truth>...</truth> blocks")
    return task.strip(), truth.strip()


def parse_python(text: str) -> str:
    """The fenced python block, which must compile."""
    m = re.search(r"```(?:python|py)?[ \t]*\n(.*?)```", text, re.DOTALL)
    if not m or not m.group(1).strip():
        raise ParseError("the answer needs one ```python fenced block")
    code = m.group(1)
    try:
        compile(code, "test.py", "exec")
    except SyntaxError as e:
        raise ParseError(f"the python block does not compile: {e}") from None
    return code


def parse_environment(text: str) -> tuple[str, dict[str, str], str]:
    """(Dockerfile, {context path: contents}, solve.sh)."""
    dockerfile, solve = _block(text, "dockerfile"), _block(text, "solve")
    if not dockerfile or not solve:
        raise ParseError("the answer needs <dockerfile>...</dockerfile> and <solve>...</solve> blocks")
    if "{{" in dockerfile:
        raise ParseError("the Dockerfile still holds a {{ }} placeholder")
    users = [i.value for i in instructions(dockerfile) if i.op == "USER" and i.value]
    if users and users[-1].split(":")[0] not in ("root", "0"):
        raise ParseError(f"the Dockerfile ends as `USER {users[-1]}`: keep root as the image's USER (the agent "
                         f"runs as `{AGENT_USER}` from task.toml; the tests must write /logs as root)")
    files = {m.group(1): m.group(2).lstrip("\n") for m in
             re.finditer(r'<file path="([^"]+)">(.*?)</file>', text, re.DOTALL)}
    return dockerfile.strip() + "\n", files, solve.strip() + "\n"


def feedback_text(gate: str, reason: str) -> str:
    """What a retry gets to see: the gate and the last characters of its error."""
    return f"gate `{gate}` failed: {reason[-FEEDBACK_CHARS:]}"
