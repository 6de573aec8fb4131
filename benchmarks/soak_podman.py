"""Soak of the podman rollout path: many episodes at high concurrency through one pool, as a
rollout worker runs them; reports leaks, driver memory and per-episode overhead.

    python benchmarks/soak_podman.py --json [--episodes 1000] [--concurrency 64] [--pool 8] [--tasks 16]
                                            [--fresh-containers]

The pool is a rollout worker's: episodes as overlays of shared containers (`OverlayPool`,
one host per task here, serving up to `concurrency` episodes at once), or with
`--fresh-containers` a `WarmPool` of a fresh container per episode, `pool` started ahead.

Each episode is a real `training.rollout.run_episode` (harness, token policy, verifier in the
container) replaying the task's oracle turns, so the policy costs nothing and what is
measured is the sandbox path. Every container carries this soak's own run label, so the leak
count sees only its containers. Reported:

* `leaked_containers`: containers of this soak still present after the pool closed (must be 0);
* `leaked_processes`: processes this one started that are still alive then, and any process
  (a `conmon`, an episode's) naming a container of the soak (must be 0);
* `leaked_dirs` / `leaked_cgroups`: state directories of its shared containers, and cgroups
  of its containers or their episodes, left after the pool closed (must be 0);
* `rss_first100_mb` / `rss_last100_mb`: this process's RSS, mean over the first and the last
  100 finished episodes (flat memory: the ratio near 1);
* `unsolved_or_failed`: why (status, error, verifier, slowest command), for up to 20 episodes
  whose oracle replay did not solve its task or that ended on an infrastructure error;
* `overhead_p50_s` / `overhead_p99_s`: episode time outside the agent (sandbox start,
  verifier, the rest of run_episode), and `infra_errors` by kind.

Timings depend on the machine's load: measure with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _stray(p) -> bool:
    """A child process that should be gone after the soak (the podman service stays)."""
    import psutil

    try:
        return "system service" not in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _leftovers(ids: set[str], root: Path) -> dict[str, int]:
    """Processes, state directories and cgroups that name one of the soak's containers."""
    import psutil

    procs = 0
    for p in psutil.process_iter(["cmdline"]):
        text = " ".join(p.info["cmdline"] or [])
        procs += any(cid in text for cid in ids)
    import os

    groups = sum(1 for _, dirs, _ in os.walk("/sys/fs/cgroup") for d in dirs if d.removeprefix("libpod-") in ids)
    return {"processes": procs, "dirs": len(list(root.glob("*/h-*"))), "cgroups": groups}


def _pool(episode, concurrency: int, pool_size: int, fresh: bool, label: dict, root: Path):
    from tmax.sandbox.overlay_pool import OverlayPool
    from tmax.sandbox.pool import WarmPool

    if fresh:
        return WarmPool(concurrency + pool_size)
    return OverlayPool(concurrency, pool_size, host_labels=label, root=root)


def soak(episodes: int, concurrency: int, pool_size: int, n_tasks: int, seed: int, fresh: bool = False) -> dict:
    import psutil
    from transformers import AutoTokenizer

    from rollout_throughput import scripted_samplers
    from tmax.training.config import preset
    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits
    from tmax.training.rollout import EpisodeRequest, EpisodeSettings, InfraError, prepare_tasks, run_ahead, run_episode

    me = psutil.Process()
    label = {"io.tmax.soak": uuid.uuid4().hex[:12]}
    with tempfile.TemporaryDirectory(prefix="tmax-soak-") as tmp:
        tasks = [str(d) for d in write_splits(Path(tmp) / "tasks", n_tasks, 1, seed=seed)["train"]]
        build_tokenizer(seed).save_pretrained(Path(tmp) / "tok")
        tok = AutoTokenizer.from_pretrained(Path(tmp) / "tok")
        rcfg = preset("nano-podman").rollout
        episode = EpisodeSettings.of(rcfg, label)
        settings = episode.env
        images = prepare_tasks(settings, tasks, log=lambda m: print(m, file=sys.stderr)).images
        sampler_for = scripted_samplers(tok, tasks)
        order = [tasks[i % len(tasks)] for i in range(episodes)]
        children_before = {p.pid for p in me.children(recursive=True)}
        results: list[dict] = []
        lock = threading.Lock()

        def one(i: int) -> dict:
            d = order[i]
            try:
                r = run_episode(EpisodeRequest(d, i, 0, i), sampler_for(d), tok, episode, image=images[d], pool=pool)
                t = r.timings
                row = {"ok": True, "reward": r.reward, "warm": r.warm_start, "container": r.container_id,
                       "mode": r.sandbox_mode, "overhead_s": t["total_s"] - t["agent_s"], "total_s": t["total_s"]}
                if r.reward < 1:  # an oracle replay that did not solve: say why
                    row["why"] = {"task": Path(d).name, "status": r.status, "steps": r.steps, "error": r.error,
                                  "verifier": r.verifier, "slowest_command_s": max(r.command_s, default=None)}
            except InfraError as e:
                row = {"ok": False, "kind": e.kind, "why": {"task": Path(d).name, "error": str(e)[:500]}}
            row["rss_mb"] = me.memory_info().rss / 2**20
            with lock:
                results.append(row)
                if len(results) % 50 == 0:  # a long soak shows where it is
                    print(f"soak: {len(results)}/{episodes} episodes, {time.monotonic() - t0:.0f} s, "
                          f"RSS {row['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
            return row

        pool = _pool(episode, concurrency, pool_size, fresh, label, Path(tmp) / "hosts")
        t0 = time.monotonic()
        try:
            run_ahead(order, one, settings, images, pool, concurrency)
        finally:
            pool.close()
        wall = time.monotonic() - t0
        time.sleep(5)  # removals finish on background threads
        left = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=io.tmax.soak={label['io.tmax.soak']}"],
                              capture_output=True, text=True).stdout.split()
        leaked = [p for p in me.children(recursive=True) if p.pid not in children_before and _stray(p)]
        rest = _leftovers({r["container"] for r in results if r["ok"] and r["container"]}, Path(tmp) / "hosts")
    ok = [r for r in results if r["ok"]]
    over = [r["overhead_s"] for r in ok]
    kinds: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    rss = [r["rss_mb"] for r in results]
    first, last = statistics.mean(rss[:100]), statistics.mean(rss[-100:])
    return {"episodes": len(results), "concurrency": concurrency, "pool": pool_size, "seconds": round(wall, 1),
            "episodes_per_min": round(60 * len(results) / wall, 1), "solved": sum(r["reward"] >= 1 for r in ok),
            "warm_starts": sum(r["warm"] for r in ok), "infra_errors": kinds,
            "leaked_containers": len(left), "leaked_processes": len(leaked) + rest["processes"],
            "leaked_dirs": rest["dirs"], "leaked_cgroups": rest["cgroups"],
            "containers_used": len({r["container"] for r in ok}),
            "modes": {m: sum(r["mode"] == m for r in ok) for m in {r["mode"] for r in ok}},
            "rss_first100_mb": round(first, 1), "rss_last100_mb": round(last, 1),
            "rss_last_vs_first": round(last / first, 3),
            "overhead_p50_s": round(_percentile(over, 0.5), 3), "overhead_p99_s": round(_percentile(over, 0.99), 3),
            "unsolved_or_failed": [r["why"] for r in results if "why" in r][:20]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--pool", type=int, default=8, help="containers started ahead beyond the running episodes")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-containers", action="store_true", help="a fresh container per episode (the old way)")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    out = soak(args.episodes, args.concurrency, args.pool, args.tasks, args.seed, args.fresh_containers)
    record_result(args, out)
    print(json.dumps(out, indent=None if args.json else 2))
    ok = all(out[k] == 0 for k in ("leaked_containers", "leaked_processes", "leaked_dirs", "leaked_cgroups"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
