"""Where one podman episode spends its time: every sandbox call of a scripted nano episode
(container start or warm take, the agent's shell commands, each exec, copy in / out, the
verifier, the container's removal), timed and listed in order, with the CPU seconds the
whole machine spent meanwhile (run it on a quiet machine: on 2 cores podman episodes are
bound by CPU, not by latency).

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALLS: list[tuple[str, float, float, str]] = []  # (call, seconds, machine CPU seconds, detail), in order
HZ = os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used (busy ticks of /proc/stat)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / HZ  # less idle and iowait


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


def alternating(ways: dict, rounds: int) -> dict:
    """Mean wall and machine CPU seconds of each way (name -> call), the ways alternating."""
    out: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for _ in range(rounds):
        for way, call in ways.items():
            t0, c0 = time.monotonic(), machine_cpu_s()
            call()
            out[way].append((time.monotonic() - t0, machine_cpu_s() - c0))
    return {way: {"wall_s": round(sum(w for w, _ in v) / rounds, 3), "cpu_s": round(sum(c for _, c in v) / rounds, 3)}
            for way, v in out.items()}


def verifier_inline_vs_copy(task_dir: str, image, cfg, rounds: int) -> dict:
    """Mean wall and machine CPU seconds of the verifier, tests inside its exec against the
    archive copy (the path larger tests take), alternating in one container."""
    from tmax.sandbox.podman import PodmanSandbox
    from tmax.tasks import verifier
    from tmax.tasks.episode import sandbox_spec
    from tmax.tasks.model import Task

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=10, help="repeats of each side-by-side comparison")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from tmax.sandbox.pool import WarmPool
    from tmax.training.config import preset
    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits
    from tmax.training.rollout import EpisodeSettings, prepare_tasks, prewarm

    cfg = EpisodeSettings.of(preset("nano").rollout.model_copy(update={"sandbox": "podman"}))
    with tempfile.TemporaryDirectory(prefix="tmax-episode-profile-") as tmp:
        build_tokenizer(0).save_pretrained(Path(tmp) / "tok")
        tok = AutoTokenizer.from_pretrained(Path(tmp) / "tok")
        dirs = [str(d) for d in write_splits(Path(tmp) / "tasks", 3, 1, seed=0)["train"]]
        images = prepare_tasks(cfg.env, dirs, log=lambda m: None).images
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
        verifier_ab = verifier_inline_vs_copy(dirs[0], images[dirs[0]], cfg, args.rounds)
        exec_ab = exec_cli_service_vs_local(images[dirs[0]].tag, args.rounds)
        seccomp_ab = seccomp_tmax_vs_default(images[dirs[0]].tag, args.rounds)
    out = {"cold": cold, "warm": warm, "verifier": verifier_ab, "podman_exec": exec_ab, "seccomp": seccomp_ab}
    if args.json:
        print(json.dumps(out))
        return
    for name in ("cold", "warm"):
        ep = out[name]
        print(f"== {name}: {ep['wall_s']} s, {ep['cpu_s']} CPU s, reward {ep['reward']}, timings {ep['timings']}")
        for c in ep["calls"]:
            print(f"  {c['s']:7.3f} s {c['cpu_s']:7.3f} CPU s  {c['call']:<8} {c['detail']}")
    for name in ("verifier", "podman_exec", "seccomp"):
        print(f"== {name} (mean of {args.rounds}): " + ", ".join(
            f"{way} {v['wall_s']} s / {v['cpu_s']} CPU s" for way, v in out[name].items()))


if __name__ == "__main__":
    main()
