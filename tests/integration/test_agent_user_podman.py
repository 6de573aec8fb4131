"""`[agent] user` on podman: the agent's shell, its one-off execs and the oracle's solve.sh
run as that user in its home, while the verifier keeps the image's USER (root) unless
`[verifier] user` says otherwise, and writes its reward; a task without the field keeps
root; an image without the user is the task's own defect (AgentUserError)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import tomli_w

from tmax.agents.tmux import TmuxSession
from tmax.sandbox.base import IMAGE_USER, AgentUserError
from tmax.tasks.episode import EnvSettings, Episode
from tmax.tasks.job import Job, JobSpec
from tmax.tasks.task_format import Task

pytestmark = [pytest.mark.podman]

if shutil.which("podman") is None or subprocess.run(
        ["podman", "image", "exists", "localhost/tmax-base:bookworm"]).returncode != 0:
    pytest.skip("needs podman and the base image", allow_module_level=True)

DOCKERFILE = """FROM localhost/tmax-base:bookworm
RUN useradd -m user && chmod -R 777 /home/user
WORKDIR /home/user
"""
# The oracle records who ran it; the verifier scores 1 when that is the expected identity
# and the file belongs to that user, and says who it ran as itself.
SOLVE = 'echo "$(id -un) $HOME $PWD" > /tmp/who.txt\n'
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
echo "verifier: $(id -un)"
if [ "$(cat /tmp/who.txt)" = "{expect}" ] && [ "$(stat -c %U /tmp/who.txt)" = "{owner}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def make_task(root: Path, name: str, user: str | None, expect: str, owner: str,
              verifier_user: str | None = None) -> Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text(DOCKERFILE)
    toml: dict = {"version": "1.0", "verifier": {"timeout_sec": 60.0, **({"user": verifier_user} if verifier_user else {})}}
    if user:
        toml["agent"] = {"timeout_sec": 60.0, "user": user}
    (d / "task.toml").write_text(tomli_w.dumps(toml))
    (d / "instruction.md").write_text("Write who you are to /tmp/who.txt.\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text(TEST_SH.format(expect=expect, owner=owner))
    (d / "solution").mkdir()
    (d / "solution" / "solve.sh").write_text(SOLVE)
    return d


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user-tasks")
    make_task(root, "as-user", "user", "user /home/user /home/user", "user")
    make_task(root, "as-root", None, "root /root /home/user", "root")
    make_task(root, "verifier-as-user", "user", "user /home/user /home/user", "user", verifier_user="user")
    return root


def test_oracle_runs_as_the_agent_user_and_the_verifier_as_root(tasks, tmp_path):
    job = Job(JobSpec(job_name="agent-user", jobs_dir=str(tmp_path), dataset=str(tasks), agent="oracle",
                        n_concurrent=2))
    data = job.run()
    rewards = {r["task"]: r["mean_reward"] for r in data.tmax_score["tasks"]}
    assert rewards == {"as-user": 1.0, "as-root": 1.0, "verifier-as-user": 1.0}
    verifier_ids = {p.parent.parent.name.split("__")[0]: p.read_text().split("verifier: ")[1].split()[0]
                    for p in tmp_path.glob("agent-user/*/verifier/test-stdout.txt")}
    assert verifier_ids == {"as-user": "root", "as-root": "root", "verifier-as-user": "user"}


def test_agent_shell_and_execs_run_as_the_user_in_its_home(tasks, tmp_path):
    task = Task.load(tasks / "as-user")
    with Episode(task, EnvSettings()) as ep:
        box = ep.open()
        shell = box.run("id -un; echo $HOME; pwd; touch mine.txt; stat -c %U mine.txt")
        assert shell.exit_code == 0 and shell.output.split() == ["user", "/home/user", "/home/user", "user"]
        one_off = box.exec(["sh", "-c", "id -un; echo $HOME; pwd"], workdir=ep.workdir)  # tmux, the oracle
        assert one_off.output.split() == ["user", "/home/user", "/home/user"]
        assert box.exec(["id", "-un"], user=IMAGE_USER).output.strip() == "root"
        denied = box.run("touch /etc/agent-was-here")
        assert denied.exit_code != 0 and "Permission denied" in denied.output
        # The harness (root) still interrupts the user's commands.
        slow = box.run("sleep 30", timeout=1)
        assert slow.timed_out and box.run("id -un").output.strip() == "user"
        if shutil.which("tmux"):  # terminus-2's tmux server, started through exec, is the user's too
            tmux = TmuxSession(box, ep.workdir)
            tmux.start()
            tmux.send_keys("echo who=$(id -un)")
            tmux.send_keys("Enter")
            deadline = time.monotonic() + 10
            while "who=user" not in tmux.capture() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "who=user" in tmux.capture()
            tmux.close()
        result = ep.verify(tmp_path / "verifier", 60)
    # The verifier ran (as root: it created /logs) and scored: who.txt was never written.
    assert result.kind == "ok" and result.reward == 0.0


def test_an_image_without_the_agent_user_is_the_tasks_defect(tasks, tmp_path):
    d = shutil.copytree(tasks / "as-user", tmp_path / "no-such-user")
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace('user = "user"', 'user = "nobody-here"'))
    with Episode(Task.load(d), EnvSettings()) as ep, pytest.raises(AgentUserError, match="nobody-here"):
        ep.open()
