"""Episodes as overlays of a shared task container (`sandbox.overlay`): each starts from the
image's state, and nothing one leaves (files anywhere, processes however detached, a
listener, a user, environment) reaches the next episode of the same container or a
concurrent one; the verifier sees its own episode; the task's limits hold per episode;
what the overlay cannot serve falls back to a fresh container, visibly.

Real podman, the nano task (a files layer: a container of the base image, the task's files
written into each episode), real bash; episodes of one container run back to back or at the
same time (a host of capacity 2)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import replace

import psutil
import pytest

from tmax.common.waiting import wait_until
from tmax.sandbox.base import SandboxError
from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory
from tmax.sandbox.overlay_proto import Process

pytestmark = pytest.mark.podman

TEST_LABEL = "io.tmax.test-overlay"


@pytest.fixture(scope="module")
def nano(tmp_path_factory, base_image):
    from transformers import AutoTokenizer

    from tmax.tasks.episode import Episode
    from tmax.tasks.task_format import Task
    from tmax.training.config import preset
    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits
    from tmax.training.rollout import EpisodeSettings, prepare_tasks

    root = tmp_path_factory.mktemp("overlay")
    build_tokenizer(0).save_pretrained(root / "tok")
    [task] = write_splits(root / "tasks", 1, 0, seed=0)["train"]
    settings = EpisodeSettings.of(preset("nano-podman").rollout)
    image = prepare_tasks(settings.env, [str(task)], log=lambda m: None).images[str(task)]
    spec = Episode(Task.load(task), settings.env, image=image).spec()
    return AutoTokenizer.from_pretrained(root / "tok"), str(task), settings, image, spec, root


@pytest.fixture(scope="module")
def pool(nano):
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    p = OverlayPool(2, host_labels=label, root=nano[5] / "hosts", close_in_background=False)
    yield p
    p.close(in_use=True)
    _remove_labelled(label)


def _remove_labelled(label: dict[str, str]) -> None:
    from tmax.sandbox.cleanup import remove_labelled

    remove_labelled(label)


def _episode(pool, spec, **changes):
    return pool.acquire("k", SpecFactory("podman", replace(spec, **changes)))


def _out(sb, command: str) -> str:
    r = sb.run(command, timeout=30)
    return r.output


# -- state --------------------------------------------------------------------------------

WRITES = {"/": "/leak-root", "/etc": "/etc/leak", "/tmp": "/tmp/leak", "$HOME": "$HOME/leak",
          "/dev/shm": "/dev/shm/leak", "/var": "/var/leak", "the workdir": "/app/leak"}


def test_files_written_anywhere_are_gone_for_the_next_episode(pool, nano):
    spec = nano[4]
    first = _episode(pool, spec)
    for path in WRITES.values():
        assert _out(first, f"echo leak > {path} && cat {path}").strip() == "leak", path
    host = first.container_id
    pool.release(first)
    second = _episode(pool, spec)
    try:
        assert second.container_id == host  # the same container, a fresh episode
        for where, path in WRITES.items():
            assert "No such file" in _out(second, f"cat {path} 2>&1"), f"a file written in {where} survived"
        assert _out(second, "cat /app/*.dat | wc -l").strip() != "0"  # the image's own files are there
    finally:
        pool.release(second)


DETACHED = {"background job": "sleep 4242 &", "double fork": "( sleep 4243 & ) &",
            "setsid": "setsid sleep 4244 < /dev/null > /dev/null 2>&1 &",
            "nohup": "nohup sleep 4245 > /dev/null 2>&1 & disown"}


def _host_sleepers() -> set[str]:
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        m = re.fullmatch(r"sleep (424[2-5])", cmd)
        if m:
            found.add(m.group(1))
    return found


def test_processes_however_detached_end_with_the_episode(pool, nano):
    spec = nano[4]
    first = _episode(pool, spec)
    for command in DETACHED.values():
        first.run(command, timeout=30)
    time.sleep(0.5)
    assert _host_sleepers() == {"4242", "4243", "4244", "4245"}  # the control: all four run
    pool.release(first)
    deadline = time.monotonic() + 10
    while _host_sleepers() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _host_sleepers()
    for kind, command in DETACHED.items():
        assert command.split("sleep ")[1][:4] not in left, f"a {kind} outlived its episode"
    second = _episode(pool, spec)
    try:
        assert "424" not in _out(second, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
    finally:
        pool.release(second)


LISTEN = ("perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalPort => 8765, Listen => 5, ReuseAddr => 1) "
          "or die; while (1) { $c = $s->accept; print $c \"hello\\n\"; close $c }' > /dev/null 2>&1 &")
CONNECT = "timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/8765 && head -1 <&3' 2>/dev/null || echo refused"
# The control: wait (on a loaded machine perl takes a while) until the listener answers.
CONNECT_WHEN_UP = f"for i in $(seq 100); do r=$({CONNECT}); [ \"$r\" = hello ] && break; sleep 0.2; done; echo $r"


def test_a_listener_is_seen_by_no_other_episode(pool, nano):
    spec = nano[4]
    first, concurrent = _episode(pool, spec), _episode(pool, spec)
    try:
        assert first.container_id == concurrent.container_id  # two episodes of one container at once
        first.run(LISTEN, timeout=30)
        assert _out(first, CONNECT_WHEN_UP).strip() == "hello"  # the control: it listens
        assert _out(concurrent, CONNECT).strip() == "refused"  # a network namespace each
    finally:
        pool.release(first)
        pool.release(concurrent)
    later = _episode(pool, spec)
    try:
        assert _out(later, CONNECT).strip() == "refused"
    finally:
        pool.release(later)


def test_an_added_user_and_changed_environment_are_gone(pool, nano):
    spec = nano[4]
    first = _episode(pool, spec)
    assert "uid=" in _out(first, "useradd intruder && id intruder")
    first.run("export LEAKVAR=1; echo 'export LEAKVAR=2' >> ~/.bashrc; echo LEAKVAR=3 >> /etc/environment",
              timeout=30)
    pool.release(first)
    second = _episode(pool, spec)
    try:
        assert "no such user" in _out(second, "id intruder 2>&1")
        assert _out(second, "echo ${LEAKVAR:-unset}").strip() == "unset"
        assert "LEAKVAR" not in _out(second, "cat ~/.bashrc /etc/environment 2>/dev/null")
        assert "intruder" not in _out(second, "cat /etc/passwd /etc/group /etc/shadow")
    finally:
        pool.release(second)


def test_each_verifier_sees_its_own_episode(nano):
    """Two episodes of one task at once in one container: the one that solved it gets 1,
    the one that wrote a wrong answer gets 0."""
    from tmax.agents.prompts import SUBMIT_COMMAND
    from tmax.training.demos import ScriptedSampler, scripted_turns
    from tmax.training.nano.tasks import oracle_steps
    from tmax.training.rollout import EpisodeRequest, run_episode

    tok, task, settings, image, _, root = nano
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    runs = {"right": scripted_turns(tok, oracle_steps(task)),
            "wrong": scripted_turns(tok, [("THOUGHT: guess.", "echo 999 > answer.txt; sleep 2"),
                                          ("THOUGHT: done.", SUBMIT_COMMAND)])}
    out: dict = {}
    with OverlayPool(2, host_labels=label, root=root / "verify-hosts") as pool:
        def one(name: str) -> None:
            out[name] = run_episode(EpisodeRequest(task, 0, len(out), 1), ScriptedSampler(runs[name]), tok, settings,
                                    image=image, pool=pool)
        threads = [threading.Thread(target=one, args=(n,)) for n in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _remove_labelled(label)
    assert out["right"].reward == 1.0 and out["wrong"].reward == 0.0
    assert out["right"].sandbox_mode == out["wrong"].sandbox_mode == "overlay+files"
    assert out["right"].container_id == out["wrong"].container_id


def test_episode_processes_lack_the_helpers_capabilities(pool, nano):
    sb = _episode(pool, nano[4])
    try:
        caps = dict(re.findall(r"(Cap\w+):\s+([0-9a-f]+)", _out(sb, "grep ^Cap /proc/self/status")))
        for name in ("CapEff", "CapPrm", "CapBnd"):
            value = int(caps[name], 16)
            assert not value & (1 << 21), f"{name} holds CAP_SYS_ADMIN"
            assert not value & (1 << 12), f"{name} holds CAP_NET_ADMIN"
        assert _out(sb, "unshare -U true 2>/dev/null; echo rc=$?").strip() == "rc=1"  # no user namespace
        assert _out(sb, "unshare -m true 2>/dev/null; echo rc=$?").strip() == "rc=1"
        assert _out(sb, "mount -t tmpfs x /mnt 2>/dev/null; echo rc=$?").strip() == "rc=32"
        assert "rc=1" in _out(sb, "echo 1 > /proc/sys/kernel/panic 2>/dev/null; echo rc=$?")  # read-only
        assert _out(sb, "cat /proc/timer_list 2>/dev/null | wc -c").strip() == "0"  # masked as in the container
    finally:
        pool.release(sb)


# -- limits, per episode ----------------------------------------------------------------------

ALIVE = "echo alive-$((6*7))"


def test_memory_past_the_limit_kills_only_inside_that_episode(pool, nano):
    spec = replace(nano[4], memory_mb=64)
    greedy, neighbour = _episode(pool, spec), _episode(pool, spec)
    try:
        assert greedy.container_id == neighbour.container_id
        neighbour.run("sleep 300 &", timeout=30)
        r = greedy.run("head -c 300m /dev/zero | tail > /dev/null; echo tail-rc=$?", timeout=60)
        assert "tail-rc=137" in r.output  # the episode's own OOM killer
        assert "alive-42" in _out(greedy, ALIVE)
        assert "sleep 300" in _out(neighbour, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")  # untouched
    finally:
        pool.release(greedy)
        pool.release(neighbour)


def test_fork_past_the_pids_limit_fails(pool, nano):
    sb = _episode(pool, replace(nano[4], pids_limit=32))
    try:
        out = _out(sb, "sh -c 'i=0; while [ $i -lt 100 ]; do sleep 2 & i=$((i+1)); done; echo all-forked'; "
                       "echo sh-rc=$?")
        assert "Cannot fork" in out and "all-forked" not in out
        assert "alive-42" in _out(sb, "sleep 3; " + ALIVE)
    finally:
        pool.release(sb)


def test_a_file_past_storage_is_cut_at_the_limit(pool, nano):
    sb = _episode(pool, replace(nano[4], storage_mb=8))
    try:
        out = _out(sb, "dd if=/dev/zero of=big bs=1M count=64 2>/dev/null; echo dd-rc=$?; "
                       "echo size=$(stat -c %s big); ulimit -f unlimited 2>&1 | tail -c 40")
        assert "dd-rc=153" in out and f"size={8 * 1024 * 1024}" in out
        assert "not permitted" in out  # the agent cannot raise the cap back
    finally:
        pool.release(sb)


def test_no_network_without_allow_internet(pool, nano):
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(4)
    gateway = subprocess.run(["podman", "network", "inspect", "podman", "--format",
                              "{{range .Subnets}}{{.Gateway}}{{end}}"], capture_output=True, text=True).stdout.strip()
    sb = _episode(pool, nano[4])  # the nano task: allow_internet = false
    try:
        assert _out(sb, "ls /sys/class/net").split() == ["lo"]
        out = _out(sb, f"timeout 5 bash -c 'exec 3<>/dev/tcp/{gateway}/{srv.getsockname()[1]}' 2>/dev/null "
                       "&& echo net=connected || echo net=blocked")
        assert "net=blocked" in out
    finally:
        pool.release(sb)
        srv.close()


# -- fallback, a killed container, leftovers ----------------------------------------------------


def test_what_the_overlay_cannot_serve_gets_a_fresh_container_visibly(pool, nano, tmp_path, caplog):
    from tmax.tasks.episode import sandbox_spec
    from tmax.tasks.task_images import ensure_image
    from tmax.tasks.task_format import Task

    workspace = tmp_path / "ws"
    workspace.mkdir()
    mounts = [(str(workspace), "/data", False)]
    task, env = Task.load(nano[1]), nano[2].env

    def own_image():  # the nano task's built image: what a container of its own runs
        return replace(sandbox_spec(task, env, ensure_image(task, env.rewrite), None), mounts=mounts)

    with caplog.at_level(logging.WARNING, logger="tmax.sandbox.overlay_pool"):
        sb = pool.acquire("k", SpecFactory("podman", replace(nano[4], mounts=mounts), own_image))
    try:
        assert sb.mode == "container" and sb.spec.files is None
        assert any("writable" in why for why in pool.fallbacks)
        assert any("fresh container" in r.getMessage() for r in caplog.records)
        sb.run("echo x > /data/out", timeout=30)
        assert (workspace / "out").read_text() == "x\n"  # it still runs, as before
    finally:
        pool.release(sb)


def _state(pid: int) -> str:
    """A host process's state letter (R, S, T stopped, Z ended and not yet reaped); "" once gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except FileNotFoundError:
        return []


def test_a_hang_up_as_its_process_ends_kills_that_process_alone(pool, nano):
    """On a busy machine the episode's pid 1 can wake to a caller's hang-up and the end of
    its process at once (a shell's close waits a moment for its end, then hangs up). Stopped
    pid 1 makes that order certain: the ended process is reaped, and nothing else goes: the
    host, another episode of it, and this episode live on."""
    spec = nano[4]
    first, other = _episode(pool, spec), _episode(pool, spec)
    try:
        assert first.container_id == other.container_id  # two episodes of one host
        pid1 = first.lease.peer_pid()
        null = os.open(os.devnull, os.O_RDWR)
        try:
            proc = Process(first.lease.sock_path, ["sleep", "0.5"], [null, null, null], user=None)
        finally:
            os.close(null)
        os.kill(pid1, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _state(pid1) == "T", 10, 0.01)
            proc.kill()  # the hang-up and the process's end both wait for pid 1's next poll
            assert wait_until(lambda: any(_state(c) == "Z" for c in _children(pid1)), 30, 0.05)
        finally:
            os.kill(pid1, signal.SIGCONT)
        assert wait_until(lambda: all(_state(c) != "Z" for c in _children(pid1)), 10, 0.05)
        assert _out(other, "echo other-alive").strip() == "other-alive"
        assert _out(first, "echo first-alive").strip() == "first-alive"
        status = subprocess.run(["podman", "inspect", "-f", "{{.State.Status}}", first.container_id],
                                capture_output=True, text=True).stdout.strip()
        assert status == "running"
    finally:
        pool.release(first)
        pool.release(other)


def test_a_killed_container_fails_its_episodes_and_the_next_gets_a_new_one(pool, nano):
    spec = nano[4]
    sb = _episode(pool, spec)
    killed = sb.container_id
    subprocess.run(["podman", "kill", killed], capture_output=True, check=True)
    with pytest.raises(SandboxError):
        for _ in range(3):  # the shell notices at its next command, its restart fails
            sb.run("echo still-here", timeout=30)
    pool.release(sb)
    fresh = _episode(pool, spec)
    try:
        assert fresh.container_id != killed
        assert "ok" in _out(fresh, "echo ok")
    finally:
        pool.release(fresh)


def test_nothing_is_left_once_the_pool_closes(nano):
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    root = nano[5] / "close-hosts"
    with OverlayPool(2, host_labels=label, root=root) as pool:
        for _ in range(3):
            sb = _episode(pool, nano[4])
            sb.run("sleep 1000 &", timeout=30)
            pool.release(sb)

    def containers() -> str:
        return subprocess.run(["podman", "ps", "-aq", "--filter", f"label={TEST_LABEL}={label[TEST_LABEL]}"],
                              capture_output=True, text=True).stdout.strip()

    deadline = time.monotonic() + 60
    while containers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert containers() == ""  # the host ended at the pool's close, and podman removed it
    assert not list(root.glob("*/h-*"))  # its state directory too


def test_a_state_root_past_the_socket_path_limit_serves_episodes(nano):
    """A socket path holds 108 bytes: hosts under a deep $HOME or $TMPDIR (here 150
    characters and more) are reached all the same (`overlay_proto.connect_unix`)."""
    deep = nano[5] / ("d" * 60) / ("e" * 60)
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    p = OverlayPool(1, host_labels=label, root=deep / "hosts", close_in_background=False)
    try:
        sb = _episode(p, nano[4])
        assert len(str(sb.lease.sock_path)) > 108
        assert _out(sb, "echo deep").strip() == "deep"
        p.release(sb)
    finally:
        p.close(in_use=True)
        _remove_labelled(label)
