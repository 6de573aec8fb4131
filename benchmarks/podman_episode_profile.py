"""Where one podman episode spends its time: every sandbox call of a scripted nano episode
(container start or warm take, the agent's shell commands, each exec, copy in / out, the
verifier, the container's removal), timed and listed in order, with the CPU seconds spent
meanwhile (on 2 cores podman episodes are bound by CPU, not by latency).

CPU seconds: where this process may (root, cgroup v1), of this benchmark alone: it moves
itself into a cgroup of its own and puts every container (and its conmon, and the
`container cleanup` conmon starts) under it (`TMAX_PODMAN_CGROUP_PARENT`), so the figures
hold on a busy machine; elsewhere the whole machine's, from /proc/stat (run it quiet then).

The two ways an episode gets its environment, alternating in one run: a fresh container
(create, start, the shell's `podman exec`, the verifier's exec, removal and cleanup) against
an episode of a container already running (`sandbox.overlay`: new namespaces over a fresh
overlay; `cpu_s_per_episode_fresh_container`, `cpu_s_per_episode_new`), and what starting
and ending such a container costs (`cpu_s_per_host_life`), paid once per worker and image.

Side by side in the same run: the verifier with its tests inside its exec against the
archive copy it falls back to for large tests, `podman exec` (how the agent's shell
starts) run as a client of the REST service against the CLI opening the container store
itself, and a container life under tmax's seccomp profile against podman's default, each
repeated and averaged.

The policy is the task's oracle through the real harness and verifier, as in
`rollout_throughput.py`. Runs the episode cold (it starts its own container) and warm
(the container was started ahead in a pool), after one unmeasured episode that warms the
image cache.

    python benchmarks/podman_episode_profile.py [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

CALLS: list[tuple[str, float, float, str]] = []  # (call, seconds, CPU seconds, detail), in order
HZ = os.sysconf("SC_CLK_TCK")
CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")
OWN_CGROUP: list[Path] = []  # this benchmark's cpuacct group, once made


def own_cgroup() -> str:
    """Move this process into a cpuacct cgroup of its own and put every container under it;
    "cgroup" when that worked, "machine" when CPU is read from /proc/stat instead."""
    from tmax.sandbox.podman import CGROUP_PARENT_ENV

    name = f"tmax-profile-{os.getpid()}"
    try:
        (CGROUP_ROOT / name / "driver").mkdir(parents=True)
        (CGROUP_ROOT / name / "driver" / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return "machine"
    OWN_CGROUP.append(CGROUP_ROOT / name)
    os.environ[CGROUP_PARENT_ENV] = f"/{name}"
    return "cgroup"


def leave_cgroup() -> None:
    """Back to the root group; the benchmark's groups go once their containers are gone."""
    if not OWN_CGROUP:
        return
    (CGROUP_ROOT / "cgroup.procs").write_text(str(os.getpid()))
    for d in sorted(Path("/sys/fs/cgroup").glob(f"*/{OWN_CGROUP[0].name}/**/"), key=lambda p: -len(p.parts)):
        try:
            d.rmdir()
        except OSError:
            pass


def machine_cpu_s() -> float:
    """CPU seconds of this benchmark's cgroup (with its containers), else of every process
    of the machine (busy ticks of /proc/stat)."""
    if OWN_CGROUP:
        return int((OWN_CGROUP[0] / "cpuacct.usage").read_text()) / 1e9
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / HZ  # less idle and iowait


def settled() -> None:
    """Wait until what an episode left running (a container's cleanup) is done: the CPU
    counter still for 0.3 s (at most 10 s)."""
    deadline = time.monotonic() + 10
    last = machine_cpu_s()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = machine_cpu_s()
        if now - last < 0.003:
            return
        last = now


def _timed(cls: type, name: str, detail=lambda *a, **k: "") -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        t0, c0 = time.monotonic(), machine_cpu_s()
        try:
            return original(self, *args, **kwargs)
        finally:
            CALLS.append((name, time.monotonic() - t0, machine_cpu_s() - c0, str(detail(*args, **kwargs))[:60]))

    setattr(cls, name, wrapper)


def instrument() -> None:
    from tmax.sandbox.podman import PodmanSandbox
    from tmax.sandbox.pool import WarmPool

    _timed(PodmanSandbox, "start")
    _timed(PodmanSandbox, "run", lambda command, *a, **k: command)
    _timed(PodmanSandbox, "exec", lambda argv, *a, **k: " ".join(argv))
    _timed(PodmanSandbox, "copy_in", lambda src, dst: dst)
    _timed(PodmanSandbox, "copy_out", lambda src, dst: src)
    _timed(PodmanSandbox, "close")
    _timed(WarmPool, "acquire")
    _timed(WarmPool, "release")


def one_episode(task_dir: str, tok, cfg, image, pool) -> dict:
    from tmax.training.nano.tasks import oracle_steps
    from tmax.training.demos import ScriptedSampler, scripted_turns
    from tmax.training.rollout import EpisodeRequest, run_episode

    turns = scripted_turns(tok, oracle_steps(task_dir))
    CALLS.clear()
    t0, c0 = time.monotonic(), machine_cpu_s()
    r = run_episode(EpisodeRequest(task_dir, 0, 0, 0), ScriptedSampler(turns), tok, cfg, image=image, pool=pool)
    wall, cpu = time.monotonic() - t0, machine_cpu_s() - c0
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "reward": r.reward, "warm": r.warm_start,
            "timings": r.timings,
            "calls": [{"call": c, "s": round(s, 3), "cpu_s": round(u, 3), "detail": d} for c, s, u, d in CALLS]}


def alternating(ways: dict, rounds: int, settle: bool = False) -> dict:
    """Mean wall and CPU seconds of each way (name -> call), the ways alternating; with
    `settle`, each call's CPU counts until what it left running has ended."""
    out: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for _ in range(rounds):
        for way, call in ways.items():
            if settle:
                settled()
            t0, c0 = time.monotonic(), machine_cpu_s()
            call()
            wall = time.monotonic() - t0
            if settle:
                settled()
            out[way].append((wall, machine_cpu_s() - c0))
    return {way: {"wall_s": round(sum(w for w, _ in v) / rounds, 3), "cpu_s": round(sum(c for _, c in v) / rounds, 3)}
            for way, v in out.items()}


def verifier_inline_vs_copy(task_dir: str, image, cfg, rounds: int) -> dict:
    """Mean wall and machine CPU seconds of the verifier, tests inside its exec against the
    archive copy (the path larger tests take), alternating in one container."""
    from tmax.sandbox.podman import PodmanSandbox
    from tmax.tasks import verifier
    from tmax.tasks.episode import sandbox_spec
    from tmax.tasks.task_format import Task

    task = Task.load(task_dir)
    sb = PodmanSandbox(sandbox_spec(task, cfg.env, image, None, None, {}))
    sb.start()
    limit = verifier.INLINE_TESTS_MAX_BYTES

    def verify(max_inline: int):
        def call() -> None:
            verifier.INLINE_TESTS_MAX_BYTES = max_inline  # -1: the archive copy larger tests take
            verifier.run_verifier(sb, task, image.workdir, None)
        return call

    try:
        return alternating({"inline": verify(limit), "copy": verify(-1)}, rounds)
    finally:
        verifier.INLINE_TESTS_MAX_BYTES = limit
        sb.close()


def exec_cli_service_vs_local(image: str, rounds: int) -> dict:
    """Mean wall and machine CPU seconds of `podman exec -i CID true`, as a client of the
    REST service (how the agent's shell starts) and as the CLI on its own, alternating."""
    import subprocess

    from tmax.sandbox import podman_service

    cid = subprocess.run(["podman", "run", "-d", "--runtime", podman_service.DEFAULT_RUNTIME, "--network", "none",
                          image, "sleep", "infinity"], capture_output=True, text=True, check=True).stdout.strip()
    def podman_exec(*podman: str):
        return lambda: subprocess.run([*podman, "exec", "-i", cid, "true"], check=True, stdin=subprocess.DEVNULL)

    try:
        return alternating({"service": podman_exec("podman", "--url", podman_service.service_url()),
                            "local": podman_exec("podman")}, rounds)
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", cid], capture_output=True)


def seccomp_tmax_vs_default(image: str, rounds: int) -> dict:
    """Mean wall and machine CPU seconds of a container life (start with the shell, one
    exec, removal) under tmax's seccomp profile (`sandbox.podman.seccomp_profile`) and under
    podman's default, alternating. Equal ways where the kernel runs x32 (no profile of ours)."""
    import tmax.sandbox.podman as podman
    from tmax.sandbox.base import SandboxSpec

    ours = podman.seccomp_profile

    def life(profile):
        def call() -> None:
            podman.seccomp_profile = profile
            sb = podman.PodmanSandbox(SandboxSpec(image=image))
            try:
                sb.start()
                sb.exec(["true"])
            finally:
                sb.close()
        return call

    try:
        return alternating({"tmax": life(ours), "podman_default": life(lambda: None)}, rounds)
    finally:
        podman.seccomp_profile = ours


def fresh_vs_overlay(task_dir: str, tok, cfg, image, rounds: int) -> dict:
    """The same scripted oracle episode, alternating: in a fresh container of its own, and
    in a fresh overlay of a container already running (its host started before, outside the
    figures); then a host's start and end by itself, for what the new way pays per host."""
    from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory
    from tmax.tasks.episode import Episode
    from tmax.tasks.task_format import Task
    from tmax.training.nano.tasks import oracle_steps
    from tmax.training.demos import ScriptedSampler, scripted_turns
    from tmax.training.rollout import EpisodeRequest, run_episode

    turns = scripted_turns(tok, oracle_steps(task_dir))
    rewards: list[float] = []

    def episode(pool):
        def call() -> None:
            r = run_episode(EpisodeRequest(task_dir, 0, 0, 0), ScriptedSampler(turns), tok, cfg, image=image,
                            pool=pool)
            rewards.append(r.reward)
        return call

    root = Path(tempfile.mkdtemp(prefix="tmax-profile-hosts-"))  # hosts of this run only, started in its cgroup
    # A recipe worker's pool: 4 episodes at once per container, each in cgroups of its own.
    pool = OverlayPool(4, root=root, close_in_background=False)
    try:
        episode(pool)()  # starts the host, unmeasured
        ab = alternating({"fresh_container": episode(None), "new": episode(pool)}, rounds, settle=True)
    finally:
        pool.close()
    spec = Episode(Task.load(task_dir), cfg.env, image=image).spec()

    def host_life() -> None:
        with OverlayPool(4, root=root, close_in_background=False) as p:
            p.release(p.acquire("k", SpecFactory("podman", spec)))

    ab["host_life_with_one_episode"] = alternating({"x": host_life}, max(2, rounds // 3), settle=True)["x"]
    ab["rewards"] = {"episodes": len(rewards), "solved": sum(rewards)}
    return ab


def breakdown(dirs: list[str], tok, cfg, images: dict, rounds: int) -> dict:
    """The call-by-call episodes (cold, warm from a pool of fresh containers) and the side by
    side comparisons of the verifier, `podman exec` and seccomp."""
    from tmax.sandbox.pool import WarmPool
    from tmax.training.rollout import prewarm

    instrument()
    one_episode(dirs[0], tok, cfg, images[dirs[0]], None)  # unmeasured: warms caches
    cold = one_episode(dirs[1], tok, cfg, images[dirs[1]], None)
    pool = WarmPool(2)
    try:
        prewarm(pool, dirs[2], cfg.env, images[dirs[2]])
        time.sleep(8)  # let the warm start finish, as it would behind a running episode
        warm = one_episode(dirs[2], tok, cfg, images[dirs[2]], pool)
    finally:
        pool.close()
    return {"cold": cold, "warm": warm, "verifier": verifier_inline_vs_copy(dirs[0], images[dirs[0]], cfg, rounds),
            "podman_exec": exec_cli_service_vs_local(images[dirs[0]].tag, rounds),
            "seccomp": seccomp_tmax_vs_default(images[dirs[0]].tag, rounds)}


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from tmax.training.config import preset
    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits
    from tmax.training.rollout import EpisodeSettings, prepare_tasks

    cfg = EpisodeSettings.of(preset("nano").rollout.model_copy(update={"sandbox": "podman"}))
    with tempfile.TemporaryDirectory(prefix="tmax-episode-profile-") as tmp:
        build_tokenizer(0).save_pretrained(Path(tmp) / "tok")
        tok = AutoTokenizer.from_pretrained(Path(tmp) / "tok")
        dirs = [str(d) for d in write_splits(Path(tmp) / "tasks", 3, 1, seed=0)["train"]]
        images = prepare_tasks(cfg.env, dirs, log=lambda m: None).images
        eps = fresh_vs_overlay(dirs[0], tok, cfg, images[dirs[0]], args.rounds)
        out = {"cpu_s_per_episode_fresh_container": eps["fresh_container"]["cpu_s"],
               "cpu_s_per_episode_new": eps["new"]["cpu_s"],
               "new_over_fresh": round(eps["new"]["cpu_s"] / max(eps["fresh_container"]["cpu_s"], 1e-9), 3),
               "cpu_s_per_host_life": eps["host_life_with_one_episode"]["cpu_s"], "episodes": eps}
        if not args.only_episodes:
            # The breakdown's episodes, verifier and execs start containers of the task's own
            # image: built, where the overlay took a files layer over the base image.
            built = prepare_tasks(replace(cfg.env, files_layer=False), dirs, log=lambda m: None).images
            out.update(breakdown(dirs, tok, cfg, built, args.rounds))
    return out


def report(out: dict, rounds: int) -> None:
    print(f"== CPU per episode ({out['cpu_source']}, mean of {rounds} alternating): fresh container "
          f"{out['cpu_s_per_episode_fresh_container']} CPU s, new {out['cpu_s_per_episode_new']} CPU s "
          f"(x{out['new_over_fresh']}); a host's life with one episode {out['cpu_s_per_host_life']} CPU s")
    for name in ("cold", "warm"):
        if name not in out:
            continue
        ep = out[name]
        print(f"== {name}: {ep['wall_s']} s, {ep['cpu_s']} CPU s, reward {ep['reward']}, timings {ep['timings']}")
        for c in ep["calls"]:
            print(f"  {c['s']:7.3f} s {c['cpu_s']:7.3f} CPU s  {c['call']:<8} {c['detail']}")
    for name in ("verifier", "podman_exec", "seccomp"):
        if name in out:
            print(f"== {name} (mean of {rounds}): " + ", ".join(
                f"{way} {v['wall_s']} s / {v['cpu_s']} CPU s" for way, v in out[name].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    ap.add_argument("--rounds", type=int, default=10, help="repeats of each side-by-side comparison")
    ap.add_argument("--only-episodes", action="store_true", help="only the fresh container / overlay comparison")
    args = ap.parse_args()
    cpu_source = own_cgroup()
    try:
        out = {"cpu_source": cpu_source, **measure(args)}
    finally:
        leave_cgroup()
    record_result(args, out)
    if args.json:
        print(json.dumps(out))
    else:
        report(out, args.rounds)


if __name__ == "__main__":
    main()
