"""The limits a task declares hold inside its podman container, in bench and learn alike
(both open their sandbox through `tasks.episode`): an agent command that allocates past
`memory_mb`, forks past `pids_limit`, writes a file past `storage_mb` or connects out with
`allow_internet = false` is stopped inside the container, the agent's next command runs,
and the episode ends as the agent's own outcome (a scored Rollout, never an InfraError).

Real podman, the nano task image, a scripted sampler; each episode takes seconds."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading

import pytest

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.training.config import preset
from tmax.training.demos import ScriptedSampler, scripted_turns
from tmax.training.rollout import EpisodeRequest, EpisodeSettings, prepare_tasks, run_episode

pytestmark = pytest.mark.podman

ALIVE = "echo alive-$((6*7))"


@pytest.fixture(scope="module")
def nano(tmp_path_factory, base_image):
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("limits")
    build_tokenizer(0).save_pretrained(root / "tok")
    [task] = write_splits(root / "tasks", 1, 0, seed=0)["train"]
    # A container of its own per episode (`rollout.overlay = false`): the task image built up front.
    episode = EpisodeSettings.of(preset("nano-podman").rollout.model_copy(update={
        "max_steps": 4, "observation_max_chars": 2000, "max_tokens": 300,
        "response_budget": 1500, "context_budget": 4096, "overlay": False}))
    prepared = prepare_tasks(episode.env, [str(task)], root / "report.json", log=lambda m: None)
    return AutoTokenizer.from_pretrained(root / "tok"), task, episode, prepared.images[str(task)], root


def _with_environment(nano, name: str, **environment) -> str:
    """A copy of the nano task whose task.toml declares `environment` (same image)."""
    _, task, _, _, root = nano
    copy = root / name / task.name
    shutil.copytree(task, copy)
    toml = (copy / "task.toml").read_text()
    for key, value in environment.items():
        toml = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", toml)
        if f"{key} = {value}" not in toml:
            toml = toml.replace("[environment]\n", f"[environment]\n{key} = {value}\n")
    (copy / "task.toml").write_text(toml)
    return str(copy)


def _episode(nano, task_dir: str, *commands: str) -> tuple[object, str]:
    """Run the agent's `commands` then submit; the Rollout and every observation it saw."""
    tok, _, episode, image, _ = nano
    turns = scripted_turns(tok, [("THOUGHT: try.", c) for c in commands] + [("THOUGHT: done.", SUBMIT_COMMAND)])
    r = run_episode(EpisodeRequest(task_dir, 0, 0, 1), ScriptedSampler(turns), tok, episode, image=image)
    obs = tok.decode([i for i, m in zip(r.trace.ids, r.trace.mask) if m == 0])
    # The agent's outcome: it ran to its submit and the verifier scored it.
    assert r.status == "submitted" and r.verifier["status"] == "ok", (r.status, r.error, obs[-800:])
    assert "alive-42" in obs, obs[-800:]  # the container survived: the next command ran
    return r, obs


def test_memory_past_the_limit_is_oom_killed_inside_the_container(nano):
    task = _with_environment(nano, "memory", memory_mb=64)
    # `tail` keeps a newline-free stream whole: 300 MB asked of a 64 MB container.
    _, obs = _episode(nano, task, "head -c 300m /dev/zero | tail > /dev/null; echo tail-rc=$?",
                      "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max; "
                      + ALIVE)
    assert "tail-rc=137" in obs  # SIGKILL from the container's OOM killer
    assert str(64 * 1024 * 1024) in obs


def test_fork_past_the_pids_limit_fails_and_the_pids_come_back(nano):
    task = _with_environment(nano, "pids", pids_limit=32)
    # dash gives up at the first failed fork (bash would retry for seconds); its children
    # are orphaned, and the container's init must reap them or they hold the pids forever.
    _, obs = _episode(nano, task,
                      "sh -c 'i=0; while [ $i -lt 100 ]; do sleep 2 & i=$((i+1)); done; echo all-forked'; echo sh-rc=$?",
                      "sleep 3; echo procs=$(ls -d /proc/[0-9]* | wc -l); " + ALIVE)
    assert "Cannot fork" in obs and "all-forked" not in obs and "sh-rc=2" in obs
    procs = int(re.search(r"procs=(\d+)", obs).group(1))
    assert procs < 10, f"{procs} processes left after the fork storm ended: orphans were not reaped"


def test_a_file_past_storage_is_cut_at_the_limit(nano):
    task = _with_environment(nano, "storage", storage_mb=8)
    _, obs = _episode(nano, task,
                      "dd if=/dev/zero of=big bs=1M count=64 2>/dev/null; echo dd-rc=$?; "
                      "echo size=$(stat -c %s big); rm -f big; ulimit -f unlimited 2>&1 | tail -c 40",
                      ALIVE)
    assert "dd-rc=153" in obs  # 128 + SIGXFSZ
    assert f"size={8 * 1024 * 1024}" in obs
    assert "not permitted" in obs  # the agent cannot raise the cap back


def _host_listener() -> tuple[socket.socket, list]:
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(8)
    srv.settimeout(0.5)
    seen: list = []

    def accept() -> None:
        while srv.fileno() != -1:
            try:
                conn, addr = srv.accept()
            except OSError:
                continue
            seen.append(addr)
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return srv, seen


def test_no_connection_out_without_allow_internet(nano):
    gateway = subprocess.run(["podman", "network", "inspect", "podman", "--format",
                              "{{range .Subnets}}{{.Gateway}}{{end}}"], capture_output=True, text=True).stdout.strip()
    assert gateway, "the podman bridge network has no gateway"
    srv, seen = _host_listener()
    port = srv.getsockname()[1]
    connect = (f"timeout 5 bash -c 'exec 3<>/dev/tcp/{gateway}/{port}' 2>/dev/null "
               "&& echo net=connected || echo net=blocked; " + ALIVE)
    try:
        _, obs = _episode(nano, _with_environment(nano, "online", allow_internet="true"), connect)
        assert "net=connected" in obs and seen  # the control: the same command reaches the host
        seen.clear()
        _, obs = _episode(nano, _with_environment(nano, "offline", allow_internet="false"), connect)
        assert "net=blocked" in obs and not seen
    finally:
        srv.close()
