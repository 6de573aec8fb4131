"""A scripted task generator for `tmax data generate` tests: answers each pipeline stage
with canned text in the formats the prompts ask for, picked by the case planted in the
task text (`CASE=<name>`), so concurrent requests get consistent answers.

Cases: good | parse_then_ok | build_then_ok | build_always | nop_then_ok | nop_always |
oracle_then_ok | oracle_always | initial_always. "_then_ok" answers break the gate on the
first try and answer correctly once the gate's error is fed back. The canned tasks work in
/app rather than the prompts' /home/user: the bwrap sandbox shows the workspace at a new
top-level directory or an existing host path, and the host has no /home/user. On podman
(`podman_setup`) the Dockerfiles also create the agent's user, as the prompts ask, and
give it /app (`PODMAN_USER_SETUP`); a host sandbox runs as the invoking user anyway.
"""

from __future__ import annotations

import re
import threading

BASE = "localhost/tmax-base:bookworm"
PODMAN_USER_SETUP = "RUN useradd -m user && chmod -R 777 /home/user && mkdir -p /app && chown user /app\n"
LOG = "boot ok\nERROR disk full\nwarn slow\nERROR fan\nok\nERROR again\nend\n"

TEMPLATE = ("<task>CASE={case}\nCount the lines of /app/data/events.log that contain the word ERROR and "
            "write the number to /app/error_count.txt.</task>\n<truth>events.log has 7 lines; 3 contain "
            "ERROR. Recompute with: grep -c ERROR /app/data/events.log</truth>")
INITIAL_OK = """```python
import os

def test_input_present():
    assert os.path.isfile("/app/data/events.log")

def test_output_absent():
    assert not os.path.exists("/app/error_count.txt")
```"""
INITIAL_BAD = """```python
import os

def test_input_present():
    assert os.path.isfile("/app/data/missing.log"), "missing.log is not there"
```"""
FINAL_OK = """```python
def test_count():
    lines = open("/app/data/events.log").read().splitlines()
    want = sum("ERROR" in line for line in lines)
    got = open("/app/error_count.txt").read().strip()
    assert got == str(want), f"{got!r} != {want}"
```"""
FINAL_TRIVIAL = "```python\ndef test_nothing():\n    assert True\n```"


def environment(dockerfile_extra: str = "", from_image: str = BASE, solve: str | None = None) -> str:
    solve = solve or "grep -c ERROR /app/data/events.log > /app/error_count.txt"
    return (f"<dockerfile>\nFROM {from_image}\n{dockerfile_extra}WORKDIR /app\nCOPY data/ data/\n</dockerfile>\n"
            f"<file path=\"data/events.log\">\n{LOG}</file>\n<solve>\n#!/bin/bash\n{solve}\n</solve>")


ENV_OK = environment()
ENV_BROKEN_BUILD = environment(from_image="docker.io/library/no-such-image:0")
ENV_WRONG_SOLVE = environment(solve="echo 42 > /app/error_count.txt")


def stage_of(body: dict) -> str:
    system = body["messages"][0]["content"]
    if "expert at creating" in system:
        return "template"
    if "BEFORE the task" in system:
        return "initial"
    if "FINAL state" in system:
        return "final"
    return "environment"


class Responder:
    """Callable for ScriptedServer: request body -> turn."""

    def __init__(self, plan: list[str], podman_setup: str = ""):
        self.plan = list(plan)
        self.podman_setup = podman_setup  # Dockerfile lines for podman runs (python3 for the tests)
        self.cases: dict[str, str] = {}
        self.lock = threading.Lock()

    def _case_for_template(self, user: str) -> str:
        key = user.split("## Previous failures")[0]
        with self.lock:
            if key not in self.cases:
                self.cases[key] = self.plan.pop(0) if self.plan else "good"
            return self.cases[key]

    def answer(self, stage: str, case: str, retry: bool) -> str:
        env_ok = environment(self.podman_setup)
        if stage == "template":
            return "<task>no truth block</task>" if case == "parse_then_ok" and not retry else TEMPLATE.format(case=case)
        if stage == "initial":
            return INITIAL_BAD if case == "initial_always" else INITIAL_OK
        if stage == "final":
            broken = case == "nop_always" or (case == "nop_then_ok" and not retry)
            return FINAL_TRIVIAL if broken else FINAL_OK
        if case == "build_always" or (case == "build_then_ok" and not retry):
            return ENV_BROKEN_BUILD
        if case == "oracle_always" or (case == "oracle_then_ok" and not retry):
            return environment(self.podman_setup, solve="echo 42 > /app/error_count.txt")
        return env_ok

    def __call__(self, body: dict) -> dict:
        stage = stage_of(body)
        user = body["messages"][-1]["content"]
        retry = "## Previous failures" in user and "None yet" not in user
        if stage == "template":
            case = self._case_for_template(user)
        else:
            m = re.search(r"CASE=(\w+)", user)
            case = m.group(1) if m else "good"
        return {"content": self.answer(stage, case, retry)}
