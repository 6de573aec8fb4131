"""Where one podman episode spends its time: every sandbox call of a scripted nano episode
(container start or warm take, the agent's shell commands, each exec, copy in / out, the
verifier, the container's removal), timed and listed in order.

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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALLS: list[tuple[str, float, str]] = []  # (call, seconds, detail), in order


def _timed(cls: type, name: str, detail=lambda *a, **k: "") -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            CALLS.append((name, time.monotonic() - t0, str(detail(*args, **kwargs))[:60]))

    setattr(cls, name, wrapper)


def instrument() -> None:
    from sandbox.podman import PodmanSandbox
    from sandbox.pool import WarmPool

    _timed(PodmanSandbox, "start")
    _timed(PodmanSandbox, "run", lambda command, *a, **k: command)
    _timed(PodmanSandbox, "exec", lambda argv, *a, **k: " ".join(argv))
    _timed(PodmanSandbox, "copy_in", lambda src, dst: dst)
    _timed(PodmanSandbox, "copy_out", lambda src, dst: src)
    _timed(PodmanSandbox, "close")
    _timed(WarmPool, "acquire")
    _timed(WarmPool, "release")


def one_episode(task_dir: str, tok, cfg, image, pool) -> dict:
    from training.nano.tasks import oracle_steps
    from training.learner.sft import ScriptedSampler, scripted_turns
    from training.rollout import EpisodeRequest, run_episode

    turns = scripted_turns(tok, oracle_steps(task_dir))
    CALLS.clear()
    t0 = time.monotonic()
    r = run_episode(EpisodeRequest(task_dir, 0, 0, 0), ScriptedSampler(turns), tok, cfg, image=image, pool=pool)
    wall = time.monotonic() - t0
    return {"wall_s": round(wall, 3), "reward": r.reward, "warm": r.warm_start, "timings": r.timings,
            "calls": [{"call": c, "s": round(s, 3), "detail": d} for c, s, d in CALLS]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from sandbox.pool import WarmPool
    from training.config import preset
    from training.nano.model import build_tokenizer
    from training.nano.tasks import write_splits
    from training.rollout import EpisodeSettings, prepare_tasks, prewarm

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
    out = {"cold": cold, "warm": warm}
    if args.json:
        print(json.dumps(out))
        return
    for name, ep in out.items():
        print(f"== {name}: {ep['wall_s']} s, reward {ep['reward']}, timings {ep['timings']}")
        for c in ep["calls"]:
            print(f"  {c['s']:7.3f}  {c['call']:<8} {c['detail']}")


if __name__ == "__main__":
    main()
