"""The learn walk: follow the run config from `tmax learn` to the loss and count its climbs.

    python benchmarks/learn_walk.py OUT.json [tmax learn arguments...]

runs `tmax learn ARGS` in this process under `sys.settrace` (call events of the main
thread only). The walk is the sequence of tmax functions in the order each is first
called (a function called again is no new step), up to the driver's call that hands the
first batch to the learner (`LearnerGroup.train_step`: the loss is computed there, in the
learner's process). Each step has a layer: its top-level package's place in
`cli > training > tasks > agents > sandbox > common`, and inside `tmax.training` its place
in the `training-layers` contract of pyproject.toml. Only functions and methods defined in
tmax's files are steps (no class or module bodies run by imports, no code dataclasses
generate). Two counts of going back up:

* an upward call: a step called from a tmax function (the nearest tmax frame below it) in a
  lower layer, e.g. a pool calling back into the code that fills it (`upward_calls`);
* a walk climb: a step whose layer is above the previous step's (`climbs`), which also
  counts every return to an upper layer that then calls something new there.

OUT.json gets both counts (in the first 400 steps and in all), each as (from, to) function
names, and how often each of the run's checks ran (`CHECKS`, every call counted).
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST = 400
END = "train_step"  # `training.cluster.actors.LearnerGroup.train_step`
CHECKS = ("refuse_fresh_run_over", "prepare_tasks", "prepare_environments", "connect", "list_task_dirs")


def layer_ranks() -> tuple[dict[str, int], dict[str, int]]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    by_id = {c["id"]: c for c in contracts}
    top = {name: i for i, name in enumerate(by_id["layers"]["layers"])}
    training = {name.strip(): i for i, line in enumerate(by_id["training-layers"]["layers"])
                for name in line.split("|")}
    return top, training


def layer_of(module: str, top: dict[str, int], training: dict[str, int]) -> tuple[int, int] | None:
    parts = module.split(".")
    if parts[0] != "tmax" or len(parts) < 2 or parts[1] not in top:
        return None
    sub = training.get(parts[2], 0) if parts[1] == "training" and len(parts) > 2 else 0
    return top[parts[1]], sub


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    top, training = layer_ranks()
    seen: set = set()
    walk: list[tuple[str, tuple[int, int]]] = []
    upward: list[tuple[int, str, str]] = []  # (step index, caller, callee)
    checks: dict[str, int] = {}
    tmax_dir = str(ROOT / "tmax")

    def finish() -> None:
        sys.settrace(None)
        climbs = [(walk[i - 1][0], walk[i][0]) for i in range(1, len(walk)) if walk[i][1] < walk[i - 1][1]]
        first = [(walk[i - 1][0], walk[i][0]) for i in range(1, min(FIRST, len(walk)))
                 if walk[i][1] < walk[i - 1][1]]
        up_first = [(a, b) for i, a, b in upward if i < FIRST]
        out.write_text(json.dumps({"steps": len(walk), "upward_calls": len(upward),
                                   f"upward_calls_first_{FIRST}": len(up_first), "upward_list": up_first,
                                   "climbs": len(climbs), f"climbs_first_{FIRST}": len(first),
                                   "reached_loss": bool(walk) and walk[-1][0].endswith(END), "checks": checks,
                                   "climbs_list": climbs, "walk": [w[0] for w in walk]}, indent=1))

    def on_call(frame, event, arg):
        if event != "call":
            return None
        code = frame.f_code
        if code.co_name in CHECKS and code.co_filename.startswith(tmax_dir):
            checks[f"{frame.f_globals.get('__name__')}.{code.co_name}"] = checks.get(
                f"{frame.f_globals.get('__name__')}.{code.co_name}", 0) + 1
        if code in seen:
            return None
        seen.add(code)
        module = frame.f_globals.get("__name__", "")
        layer = layer_of(module, top, training)
        if (layer is None or code.co_name.startswith("<") or not code.co_flags & inspect.CO_OPTIMIZED
                or not code.co_filename.startswith(tmax_dir)):
            return None
        name = f"{module}.{code.co_qualname}"
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(tmax_dir):
            caller = caller.f_back
        if caller is not None:
            caller_module = caller.f_globals.get("__name__", "")
            caller_layer = layer_of(caller_module, top, training)
            if caller_layer is not None and layer < caller_layer:
                upward.append((len(walk), f"{caller_module}.{caller.f_code.co_qualname}", name))
        walk.append((name, layer))
        if module == "tmax.training.cluster.actors" and code.co_name == END:
            finish()
        return None

    sys.argv = ["tmax", "learn", *argv]
    threading.settrace(lambda *a: None)  # other threads untraced
    sys.settrace(on_call)
    from tmax.cli.main import app

    try:
        app(prog_name="tmax")
    finally:
        if not out.exists():
            finish()


if __name__ == "__main__":
    main()
