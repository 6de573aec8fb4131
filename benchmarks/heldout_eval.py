"""The nano recipe's held-out eval (`training.recipe.heldout_eval`: a `tmax bench` job of the
`tmax` harness against the engine's server), two settings side by side:

* `--compare threads` (default): the engine's torch threads (`engine.cpu_threads`), vLLM's
  default (every core) against one thread, in local sandboxes;
* `--compare warm`: trials in podman containers, each started when its trial begins
  (`eval.warm_ahead = 0`, the default) against one container started ahead per running
  trial (`eval.warm_ahead = eval.concurrency`).

    python benchmarks/heldout_eval.py --model DIR [--compare threads|warm] [--tasks 64] [--rounds 2] [--json]

The eval is the preset's: `--tasks` generated held-out tasks x `eval.attempts`, at
`eval.concurrency`. Printed per setting and round: the eval's wall seconds, its pass rate,
and the CPU seconds of the engine core, the API server, this process (the agents, the job's
bookkeeping) and its children (sandbox shells, verifiers). Rounds alternate the settings,
so a noisy machine loads both alike. Use a trained checkpoint (the recipe's `sft/`): a
random-weights model writes no commands. `--compare warm` needs podman and the base image
(the task images are built once, before the first round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

# --compare: setting name -> (engine.cpu_threads, eval.sandbox, eval.warm_ahead; -1: eval.concurrency)
COMPARISONS = {
    "threads": {"vllm_default": (None, "local", 0), "one_thread": (1, "local", 0)},
    "warm": {"cold_start": (None, "podman", 0), "warm_ahead": (None, "podman", -1)},
}


def _cpu_s(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def cpu_by_part(engine) -> dict[str, float]:
    """CPU seconds so far: the engine core, the API server (with its guard), this process
    and the children it waited for."""
    import psutil

    guard = psutil.Process(engine.server.proc.pid)
    procs = [guard, *guard.children(recursive=True)]
    core = sum(_cpu_s(p) for p in procs if "EngineCore" in " ".join(p.cmdline()))
    me = psutil.Process()
    t = me.cpu_times()
    return {"engine_core": core, "api_server": sum(_cpu_s(p) for p in procs) - core, "driver": _cpu_s(me),
            "sandboxes": t.children_user + t.children_system}


def one_round(model: Path, setting: tuple, held_dir: Path, jobs_dir: Path) -> dict:
    from tmax.training.config import preset
    from tmax.training.inference.engine import VLLMEngine
    from tmax.training.recipe import heldout_eval

    cfg = preset("nano")
    threads, sandbox, warm = setting
    cfg.engine.cpu_threads = threads
    cfg.eval.sandbox = sandbox
    cfg.eval.warm_ahead = cfg.eval.concurrency if warm < 0 else warm

    class Group:  # what heldout_eval asks of the recipe's engine group
        def info(self) -> dict:
            return {"model": engine.served_model_name, "base_url": engine.base_url}

    with VLLMEngine.from_config(cfg.engine, model) as engine:
        before = cpu_by_part(engine)
        res = heldout_eval(cfg, Group(), str(held_dir), jobs_dir, f"eval-{time.time_ns()}", log=lambda m: None)
        after = cpu_by_part(engine)
    return {"wall_s": round(res.seconds, 1), "pass_rate": res.pass_rate, "trials": res.trials,
            "infra_errors": res.infra_errors, "cpu_s": {k: round(after[k] - before[k], 1) for k in after}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint dir (e.g. a recipe run's sft/)")
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="threads")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    from tmax.training.nano.tasks import write_splits

    settings = COMPARISONS[args.compare]
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="heldout-eval-") as tmp:
        held = Path(tmp) / "tasks"
        write_splits(held, 0, args.tasks, seed=0)
        if args.compare == "warm":
            build_images(held / "heldout")
        for r in range(args.rounds):
            order = list(settings) if r % 2 == 0 else list(reversed(settings))
            for name in order:
                res = one_round(args.model, settings[name], held / "heldout", Path(tmp) / "jobs")
                runs[name].append(res)
                if not args.json:
                    print(f"round {r + 1} {name}: {res}", flush=True)
    summary = {name: {"wall_s_median": statistics.median(x["wall_s"] for x in rs), "rounds": rs}
               for name, rs in runs.items()}
    first, second = settings
    ratio = summary[first]["wall_s_median"] / summary[second]["wall_s_median"]
    out = {"settings": summary, f"wall_ratio_{first}_over_{second}": round(ratio, 2)}
    record_result(args, out)
    print(json.dumps(out, indent=1) if args.json else f"eval wall, {first} / {second}: {ratio:.2f}x")


def build_images(task_root: Path) -> None:
    """Every held-out task's image, so that no round pays for the builds."""
    from tmax.tasks.episode import prepare_environments
    from tmax.training.rollout import env_settings

    prepare_environments(sorted(str(d) for d in task_root.iterdir()), env_settings("podman", []))


if __name__ == "__main__":
    main()
