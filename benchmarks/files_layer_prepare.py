"""Preparing nano task environments and running one episode each: built images against files
layers, side by side in one run.

Every nano task's Dockerfile is FROM the base image, WORKDIR, COPY: a files layer
(`tasks.files_layer`). Built, each task is a `podman build` when prepared and a container of
its own image (an overlay host) for its episodes; as a files layer, nothing is built and one
container of the base image serves every task's episodes, the task's files written into
each episode's root. Each way gets `--tasks` freshly generated tasks (new contents, so no
build is cached), prepared as `tmax learn` prepares them (`training.rollout.prepare_tasks`)
and then one scripted oracle episode each through an overlay pool, `--concurrency` at a time
(`training.rollout.run_ahead`), as rollouts run. Wall and CPU seconds of each phase; CPU is
this benchmark's cgroup with its podman processes and containers where it can make one
(root, cgroup v1), else the machine's (`podman_episode_profile.own_cgroup`). The images the
built way made are removed at the end.

    python benchmarks/files_layer_prepare.py [--tasks 64] [--concurrency 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

from benchmarks.podman_episode_profile import leave_cgroup, machine_cpu_s, own_cgroup  # noqa: E402

LABEL = "io.tmax.bench-files-layer"


def one_way(name: str, root: Path, n: int, concurrency: int, files_layer: bool, tok) -> dict:
    """Generate `n` fresh tasks, prepare their environments and run one oracle episode each."""
    from tmax.sandbox.overlay_pool import OverlayPool
    from tmax.training.config import preset
    from tmax.training.demos import ScriptedSampler, scripted_turns
    from tmax.training.nano.tasks import oracle_steps, write_splits
    from tmax.training.rollout import EpisodeRequest, EpisodeSettings, prepare_tasks, run_ahead, run_episode

    settings = EpisodeSettings.of(preset("nano-podman").rollout)
    settings = replace(settings, env=replace(settings.env, files_layer=files_layer))
    dirs = [str(d) for d in write_splits(root / name, n, 0, seed=random.randrange(1 << 30))["train"]]
    t0, c0 = time.monotonic(), machine_cpu_s()
    prepared = prepare_tasks(settings.env, dirs, log=lambda m: None)
    t1, c1 = time.monotonic(), machine_cpu_s()
    pool = OverlayPool(concurrency, host_labels={LABEL: uuid.uuid4().hex[:12]}, root=root / "hosts",
                       close_in_background=False)

    def episode(i: int):
        turns = scripted_turns(tok, oracle_steps(dirs[i]))
        return run_episode(EpisodeRequest(dirs[i], i, 0, 0), ScriptedSampler(turns), tok, settings,
                           image=prepared.images[dirs[i]], pool=pool)

    try:
        rollouts = run_ahead(dirs, episode, settings.env, prepared.images, pool, concurrency)
    finally:
        pool.close()  # the hosts it started end here: their removal counts too
    t2, c2 = time.monotonic(), machine_cpu_s()
    images = prepared.images.values()
    return {"prepare_s": round(t1 - t0, 1), "prepare_cpu_s": round(c1 - c0, 1),
            "episodes_s": round(t2 - t1, 1), "episodes_cpu_s": round(c2 - c1, 1),
            "total_s": round(t2 - t0, 1), "total_cpu_s": round(c2 - c0, 1),
            "built": sum(i.built for i in images), "files_layers": sum(i.files is not None for i in images),
            "hosts_started": pool.hosts_started, "modes": sorted({r.sandbox_mode for r in rollouts}),
            "passed": sum(r.reward == 1.0 for r in rollouts), "tasks": len(dirs),
            "tags": sorted(i.tag for i in images if i.built)}


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer

    cpu = own_cgroup()
    out: dict = {"cpu_of": cpu, "tasks": args.tasks, "concurrency": args.concurrency, "load_before": _load()}
    with tempfile.TemporaryDirectory(prefix="tmax-files-layer-") as tmp:
        root = Path(tmp)
        build_tokenizer(0).save_pretrained(root / "tok")
        tok = AutoTokenizer.from_pretrained(root / "tok")
        tags: list[str] = []
        try:
            for r in range(args.rounds):
                for name, files in (("built", False), ("files", True)):
                    got = one_way(f"{name}-{r}", root, args.tasks, args.concurrency, files, tok)
                    tags += got.pop("tags")
                    out.setdefault(name, []).append(got)
        finally:
            leave_cgroup()
            for i in range(0, len(tags), 32):
                subprocess.run(["podman", "rmi", *tags[i:i + 32]], capture_output=True)
    out["load_after"] = _load()
    for key in ("prepare_s", "prepare_cpu_s", "total_s", "total_cpu_s"):
        built, files = (sum(x[key] for x in out[w]) for w in ("built", "files"))
        out[f"ratio_{key}"] = round(built / files, 2) if files else None
    return out


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="each way this many times, alternating")
    p.add_argument("--json", action="store_true")
    add_record_arguments(p, __file__)
    args = p.parse_args()
    out = measure(args)
    record_result(args, out)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for way in ("built", "files"):
        for r in out[way]:
            print(f"{way:6} prepare {r['prepare_s']:7.1f} s ({r['prepare_cpu_s']:7.1f} CPU s)  episodes "
                  f"{r['episodes_s']:7.1f} s ({r['episodes_cpu_s']:7.1f} CPU s)  total {r['total_s']:7.1f} s "
                  f"({r['total_cpu_s']:7.1f} CPU s)  built {r['built']}, hosts {r['hosts_started']}, "
                  f"{r['passed']}/{r['tasks']} passed, {r['modes']}")
    print(f"built / files: prepare {out['ratio_prepare_s']}x wall, {out['ratio_prepare_cpu_s']}x CPU; "
          f"prepare + episodes {out['ratio_total_s']}x wall, {out['ratio_total_cpu_s']}x CPU "
          f"(CPU of the {out['cpu_of']}; load {out['load_before']} -> {out['load_after']})")


if __name__ == "__main__":
    main()
