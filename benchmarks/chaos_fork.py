"""Chaos for forked episodes (`sandbox.fork`) at the pool level: real forks of podman overlay
episodes (`OverlayPool.fork`), faults injected while they run or while they are made, then a
check that nothing was lost and nothing leaked. `tmax learn` does not fork yet (no branching
rollouts), so `chaos_learn.py` cannot drive forks; this is their chaos run.

    python benchmarks/chaos_fork.py --json [--rounds 3] [--seed 0] [--record]

Per round, on a pool of its own (a run label on its containers, a state root of its own):

* `container`: an episode runs a prefix (a file, a cwd, an export) and is forked twice; its
  three branches (two children and the parent's continuation, one host) each run a command
  of a few seconds, and at a seeded moment the host's container is SIGKILLed (`podman kill`).
  Each branch must fail where a trainer sees it (a SandboxError, or a note that its shell
  died, then a SandboxError at the next command): `silent` counts branches that reported
  success after the kill (must be 0). Recovered: a new episode of the same spec, on a new
  host, runs and forks.
* `fork_halfway`: the child's episode is SIGKILLed while it starts (its pid 1, as soon as its
  socket appears, after the parent's episode was frozen): the fork must raise, and the parent
  must come back with its files, cwd and exports (`parent_kept`).
* `forker_killed`: a process forking in a loop is SIGKILLed at a seeded moment (`kill -9`,
  mid-fork or between forks): the host must give back every room and layer it held.

Leaks, after each round's pool closed: the run's containers (`podman ps -a` by label), host
state directories and frozen layers under the round's root, cgroup directories of the run's
containers (episodes' `tmax-ep-*` ones included), and processes naming the run's containers
(conmon). All must be 0. A state directory left empty (a host whose helper ended, after a
process was killed before it could remove the directory) is listed apart: the next pool's
or `tmax sandbox clean`'s sweep removes it once older than `overlay_pool.STALE_START_S`.
Run it under `flock /work/heavy.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

LABEL = "io.tmax.chaos-fork"
LONG = "for i in $(seq 1 30); do echo $i >> mine; sleep 0.1; done; echo done-$V"


def _peer_pid(sock_path: Path) -> int | None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(sock_path))
            return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except OSError:
        return None


def _run_branch(sb, outcome: dict) -> None:
    """The branch's long command, then up to two more: what it reported."""
    from tmax.sandbox.base import SandboxError

    try:
        r = sb.run(LONG, timeout=60)
        outcome.update(exit_code=r.exit_code, note=r.note or "", ended=time.monotonic())
        for _ in range(2):
            sb.run("true", timeout=30)
        outcome["error"] = ""
    except SandboxError as e:
        outcome.update(error=str(e)[:120], ended=outcome.get("ended", time.monotonic()))


def container_round(pool, factory, rng: random.Random) -> dict:
    from tmax.sandbox.base import SandboxError

    parent = pool.acquire("chaos", factory)
    parent.run("mkdir -p /root/w && cd /root/w && echo base > f && export V=1", timeout=60)
    branches = [pool.fork(parent).sandbox, pool.fork(parent).sandbox, parent]
    outcomes: list[dict] = [{} for _ in branches]
    threads = [threading.Thread(target=_run_branch, args=(sb, o)) for sb, o in zip(branches, outcomes)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.5, 2.0))
    seen = bool(_cgroups_of(parent.container_id))  # the leak check finds a live container's groups
    killed_at = time.monotonic()
    subprocess.run(["podman", "kill", parent.container_id], capture_output=True)
    for t in threads:
        t.join(120)
    completed = sum(1 for o in outcomes if o.get("exit_code") == 0 and o.get("ended", 0) < killed_at)
    detected = sum(1 for o in outcomes if o.get("error"))
    silent = len(outcomes) - completed - detected
    cid = parent.container_id
    for sb in branches:
        pool.release(sb)
    t0 = time.monotonic()
    try:
        fresh = pool.acquire("chaos", factory)
        fresh.run("echo y > /root/g", timeout=60)
        child = pool.fork(fresh).sandbox
        recovered = child.run("cat /root/g", timeout=60).output.strip() == "y" and fresh.container_id != cid
        for sb in (child, fresh):
            pool.release(sb)
    except SandboxError:
        recovered = False
    return {"branches": len(branches), "completed_before_kill": completed, "detected": detected, "silent": silent,
            "recovered": recovered, "seconds_to_recover": round(time.monotonic() - t0, 2),
            "cgroups_seen_while_live": seen, "containers": [cid]}


def fork_halfway_round(pool, factory, rng: random.Random) -> dict:
    """The child's episode killed while it starts; the parent must come back as it was."""
    from tmax.sandbox.base import SandboxError

    parent = pool.acquire("chaos", factory)
    parent.run("mkdir -p /root/k && cd /root/k && echo kept > mine && export V=7", timeout=60)
    state_dir = Path(parent.host.state_dir)
    before = {p.name for p in state_dir.glob("ep-*.sock")}
    hit: list[int] = []
    stop = threading.Event()

    def kill_the_child_as_it_starts() -> None:
        while not stop.is_set():
            for sock in state_dir.glob("ep-*.sock"):
                pid = _peer_pid(sock) if sock.name not in before else None
                if pid:
                    time.sleep(rng.uniform(0, 0.005))  # somewhere in its cgroups' or shell's start
                    os.kill(pid, signal.SIGKILL)
                    hit.append(pid)
                    return
            time.sleep(0.0005)

    watcher = threading.Thread(target=kill_the_child_as_it_starts, daemon=True)
    watcher.start()
    try:
        child = pool.fork(parent).sandbox
        raised = False
        pool.release(child)  # the kill came after the child was made: it dies at its first command
    except SandboxError:
        raised = True
    stop.set()
    watcher.join(5)
    kept = parent.run("cat mine; pwd; echo $V", timeout=60).output.strip() == "kept\n/root/k\n7"
    cid = parent.container_id
    pool.release(parent)
    rooms = _rooms_free(state_dir, pool.slots)
    return {"injected": bool(hit), "fork_raised": raised, "parent_kept": kept, "rooms_free": rooms,
            "containers": [cid]}


_FORKER = """
import sys
from tmax.sandbox import SandboxSpec
from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory
pool = OverlayPool(3, host_labels={sys.argv[3]: sys.argv[4]}, root=sys.argv[1], close_in_background=False)
parent = pool.acquire("k", SpecFactory("podman", SandboxSpec(image=sys.argv[2], workdir="/root")))
parent.run("echo x > /root/f")
print(parent.host.state_dir, parent.container_id, flush=True)
while True:
    pool.release(pool.fork(parent).sandbox)
    parent.run("echo y >> /root/f")
"""


def forker_killed_round(root: Path, image: str, label: dict[str, str], rng: random.Random) -> dict:
    """A process forking in a loop, SIGKILLed: its host gives back every room and layer."""
    from tmax.sandbox.overlay_proto import quit_host

    (key, value), = label.items()
    p = subprocess.Popen([sys.executable, "-c", _FORKER, str(root), image, key, value], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    state_dir, cid = p.stdout.readline().split()
    time.sleep(rng.uniform(0.5, 2.0))
    p.send_signal(signal.SIGKILL)
    p.wait()
    state = Path(state_dir)
    rooms = _rooms_free(state, 3)
    layers_left = _wait_empty(state / "layers")
    quit_host(state)
    return {"injected": True, "rooms_free": rooms, "layers_left": layers_left, "containers": [cid], "sweep": True}


def _wait_empty(d: Path, wait_s: float = 10.0) -> int:
    from tmax.common.waiting import wait_until

    wait_until(lambda: not any(d.glob("*")), wait_s, 0.1)
    return len(list(d.glob("*")))


def _rooms_free(state_dir: Path, capacity: int, wait_s: float = 10.0) -> bool:
    """Whether the host takes `capacity` new episodes (every room given back), within `wait_s`."""
    from tmax.sandbox.overlay_proto import EpisodeLease, HostBusy, HostGone

    deadline = time.monotonic() + wait_s
    while True:
        leases = []
        try:
            for _ in range(capacity):
                leases.append(EpisodeLease(state_dir, uuid.uuid4().hex[:12], True))
            return True
        except (HostBusy, HostGone):
            if time.monotonic() > deadline:
                return False
        finally:
            for lease in leases:
                lease.close()
        time.sleep(0.2)


def _cgroups_of(cid: str) -> list[str]:
    """The cgroup directories of container `cid` (its episodes' inside them)."""
    r = subprocess.run(["find", "/sys/fs/cgroup", "-maxdepth", "6", "-type", "d", "-name", f"*{cid}*"],
                       capture_output=True, text=True)
    return r.stdout.split() if len(cid) >= 12 else []


def leaks(root: Path, label: dict[str, str], containers: list[str], sweep: bool,
          wait_s: float = 60.0) -> tuple[dict, int]:
    """What is left of the run: containers, state directories and layers, cgroups, processes.
    With `sweep`, state directories of hosts that are gone are first removed as the next pool
    (or `tmax sandbox clean`) does: what a killed process could not remove itself."""
    from tmax.common.waiting import wait_until
    from tmax.sandbox.overlay_pool import remove_host_dirs

    (key, value), = label.items()

    def left_containers() -> list[str]:
        return subprocess.run(["podman", "ps", "-aq", "--filter", f"label={key}={value}"], capture_output=True,
                              text=True).stdout.split()

    wait_until(lambda: not left_containers(), wait_s, 0.5)
    swept = remove_host_dirs(root) if sweep else []
    cgroups = [d for cid in containers for d in _cgroups_of(cid)]
    procs = subprocess.run(["pgrep", "-af", "|".join(c[:12] for c in containers)], capture_output=True,
                           text=True).stdout.split("\n") if containers else []
    # An empty one is a host that ended (its helper removed what was in it) or one starting:
    # the next sweep takes it once older than STALE_START_S. Counted apart, not as a leak.
    dirs = list(root.glob("*/h-*"))
    empty = [str(d) for d in dirs if not any(d.iterdir())]
    return {"containers": left_containers(), "state_dirs": [str(d) for d in dirs if str(d) not in empty],
            "empty_state_dirs": empty,
            "cgroups": cgroups, "processes": [p for p in procs if p.strip() and "pgrep" not in p]}, len(swept)


def one_round(kind: str, image: str, rng: random.Random) -> dict:
    from tmax.sandbox import SandboxSpec
    from tmax.sandbox.cleanup import remove_labelled
    from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory

    label = {LABEL: uuid.uuid4().hex[:12]}
    root = Path(tempfile.mkdtemp(prefix="tmax-chaos-fork-"))
    factory = SpecFactory("podman", SandboxSpec(image=image, workdir="/root", memory_mb=512))
    try:
        if kind == "forker_killed":
            row = forker_killed_round(root, image, label, rng)
        else:
            pool = OverlayPool(4, host_labels=label, root=root, close_in_background=False)
            try:
                row = (container_round if kind == "container" else fork_halfway_round)(pool, factory, rng)
            finally:
                pool.close(in_use=True)
        row["leaks"], row["state_dirs_swept"] = leaks(root, label, row.pop("containers"), row.pop("sweep", False))
    finally:
        remove_labelled(label)
    row["leaked"] = sum(len(v) for k, v in row["leaks"].items() if k != "empty_state_dirs")
    return row


def run(rounds: int, seed: int, image: str) -> dict:
    rng = random.Random(seed)
    out: dict = {"machine": f"shared, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the start",
                 "seed": seed}
    for kind in ("container", "fork_halfway", "forker_killed"):
        out[kind] = [one_round(kind, image, rng) for _ in range(rounds)]
    c, h, k = out["container"], out["fork_halfway"], out["forker_killed"]
    out["ok"] = {
        "container_no_silent_branch": all(r["silent"] == 0 for r in c),
        "container_recovered": all(r["recovered"] for r in c),
        "fork_halfway_parent_kept": all(r["parent_kept"] and r["rooms_free"] for r in h),
        "forker_killed_rooms_and_layers_back": all(r["rooms_free"] and r["layers_left"] == 0 for r in k),
        "nothing_leaked": all(r["leaked"] == 0 for r in c + h + k),
    }
    out["load_at_end"] = round(os.getloadavg()[0], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each fault")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", default=None, help="the episodes' image (default: tmax's base image)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    from tmax.tasks.task_images import BASE_TAG

    result = run(args.rounds, args.seed, args.image or BASE_TAG)
    record_result(args, result)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for kind in ("container", "fork_halfway", "forker_killed"):
        for r in result[kind]:
            print(kind, {k: v for k, v in r.items() if k != "leaks"})
    print("ok:", result["ok"])


if __name__ == "__main__":
    main()
