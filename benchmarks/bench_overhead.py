"""tmax's own cost per bench trial: the same oracle trial through `tmax bench run`, through a
bare podman-CLI script, and (when Harbor is installed) through `harbor run -e podman`.

    python benchmarks/bench_overhead.py [--task DIR] [--runs 3] [--json] [--no-harbor] [--baseline CHECKOUT]

The floor script does only what any harness must: start a container from the task's image,
copy solution/ in, run solve.sh, copy tests/ in, run test.sh, copy the verifier's output
out, remove the container. Every figure is the median of `--runs` runs, interleaved
(tmax, floor, Harbor, tmax, ...) so that a change in the machine's load hits all alike;
the load average is printed with them. The image is built (and cached) before timing.

    tmax_s      wall time of `python -m tmax.cli.main bench run TASK -a oracle` (a fresh process:
                imports, image lookup, container, oracle, verifier, results, removal)
    floor_s     wall time of the bare podman script
    overhead_s  tmax_s - floor_s: what tmax adds to a trial
    harbor_s    wall time of `harbor run -p TASK -a oracle -e podman` (needs .venv-harbor and a
                podman compose frontend on PATH), and harbor_ratio = harbor_s / tmax_s; a Harbor
                run that fails (its preflight gives `podman info` 10 s) is listed, not fatal
                Offline, Harbor builds the task's Dockerfile as written: its FROM image must be
                here under that name (e.g. `podman tag localhost/tmax-base:bookworm ubuntu:24.04`).
    baseline_s  with --baseline: the same as tmax_s for another checkout of tmax (before a change)
    *_cpu_s     CPU seconds (user + system) of that command and every process it waited for
                (podman CLI calls, the REST service tmax starts); on a loaded machine they vary
                far less than wall time
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

DEFAULT_TASK = REPO / "tests" / "data" / "tasks" / "echo-hello"
HARBOR = REPO / ".venv-harbor" / "bin" / "harbor"

FLOOR_SCRIPT = r"""
set -e
cid=$(podman run -d --network none --label io.tmax.bench=floor -w "$WORKDIR" "$IMAGE" sleep infinity)
trap 'podman rm -f -t 0 "$cid" > /dev/null' EXIT  # removal is part of the floor, and happens on failure too
podman cp "$TASK/solution" "$cid:/solution"
podman exec -w "$WORKDIR" "$cid" bash /solution/solve.sh > "$OUT/oracle.txt" 2>&1 || true
podman cp "$TASK/tests" "$cid:/tests"
podman exec -w "$WORKDIR" "$cid" bash -c 'mkdir -p /logs/verifier && bash /tests/test.sh' > "$OUT/test.txt" 2>&1 || true
podman cp "$cid:/logs/verifier" "$OUT/verifier"
cat "$OUT/verifier/reward.txt"
"""


CPU: dict[str, list[float]] = {}  # arm -> CPU seconds of each run


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
           arm: str = "") -> tuple[float, str]:
    t0, c0 = time.monotonic(), _cpu()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=1800)
    elapsed = time.monotonic() - t0
    CPU.setdefault(arm, []).append(_cpu() - c0)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]}... failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return elapsed, proc.stdout


def _image(task_dir: Path):
    from tmax.tasks.task_images import ensure_image
    from tmax.tasks.task_format import Task
    from tmax.tasks.offline import default_config

    return ensure_image(Task.load(task_dir), default_config([]))


def run_tmax(task_dir: Path, out: Path, name: str, repo: Path = REPO) -> float:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    elapsed, _ = _timed([sys.executable, "-m", "tmax.cli.main", "bench", "run", str(task_dir), "-a", "oracle",
                         "-o", str(out), "--job-name", name], env=env, arm="tmax" if repo == REPO else "baseline")
    (trial,) = [d for d in (out / name).iterdir() if d.is_dir() and not d.name.startswith(".")]
    outcome = json.loads((trial / "result.json").read_text())["tmax"]["outcome"]
    assert outcome in ("pass", "fail"), f"tmax job {name}: {outcome}"
    return elapsed


def run_floor(task_dir: Path, image, out: Path) -> float:
    out.mkdir(parents=True)
    env = {**os.environ, "IMAGE": image.tag, "WORKDIR": image.workdir or "/", "TASK": str(task_dir), "OUT": str(out)}
    elapsed, reward = _timed(["bash", "-c", FLOOR_SCRIPT], env=env, arm="floor")
    assert reward.strip() in ("0", "1"), f"floor script gave no reward: {reward!r}"
    return elapsed


def harbor_missing() -> str | None:
    if not HARBOR.exists():
        return f"{HARBOR} is not installed (scripts/setup.sh builds it where Python >= 3.12 exists)"
    if shutil.which("podman-compose") is None and subprocess.run(
            ["podman", "compose", "version"], capture_output=True).returncode != 0:
        return "no podman compose frontend on PATH (Harbor's podman environment needs podman-compose)"
    return None


def run_harbor(task_dir: Path, out: Path, name: str) -> float:
    elapsed, _ = _timed([str(HARBOR), "run", "-p", str(task_dir), "-a", "oracle", "-e", "podman", "-o", str(out),
                         "--job-name", name, "-y"], cwd=out, arm="harbor")
    return elapsed


def measure(task_dir: Path, runs: int, with_harbor: bool, baseline: Path | None = None) -> dict:
    image = _image(task_dir)
    why_no_harbor = harbor_missing() if with_harbor else "not asked (--no-harbor)"
    times: dict[str, list[float]] = {"tmax": [], "floor": [], "harbor": [], "baseline": []}
    harbor_failures: list[str] = []

    def harbor(name: str) -> None:
        try:
            times["harbor"].append(run_harbor(task_dir, root, name))
        except RuntimeError as e:
            harbor_failures.append(str(e)[-300:])

    with tempfile.TemporaryDirectory(prefix="tmax-bench-overhead-") as tmp:
        root = Path(tmp)
        if why_no_harbor is None:
            harbor("warmup")  # Harbor builds (caches) its own image first
            times["harbor"].clear()
        for i in range(runs):
            times["tmax"].append(run_tmax(task_dir, root / "tmax", f"r{i}"))
            times["floor"].append(run_floor(task_dir, image, root / f"floor{i}"))
            if baseline is not None:
                times["baseline"].append(run_tmax(task_dir, root / "baseline", f"b{i}", repo=baseline))
            if why_no_harbor is None:
                harbor(f"h{i}")
    tmax_s, floor_s = statistics.median(times["tmax"]), statistics.median(times["floor"])
    out = {
        "task": task_dir.name, "runs": runs, "tmax_s": round(tmax_s, 3), "floor_s": round(floor_s, 3),
        "overhead_s": round(tmax_s - floor_s, 3), "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "samples": {k: [round(x, 3) for x in v] for k, v in times.items() if v},
    }
    for arm in ("tmax", "floor", "baseline", "harbor"):
        if times[arm]:  # the runs that were timed (not Harbor's warm-up or failures)
            out[f"{arm}_cpu_s"] = round(statistics.median(CPU[arm][-len(times[arm]):]), 3)
    if times["baseline"]:
        out["baseline_s"] = round(statistics.median(times["baseline"]), 3)
        out["baseline_overhead_s"] = round(out["baseline_s"] - floor_s, 3)
    if times["harbor"]:
        out["harbor_s"] = round(statistics.median(times["harbor"]), 3)
        out["harbor_ratio"] = round(out["harbor_s"] / tmax_s, 2)
    else:
        out["harbor_skipped"] = why_no_harbor or "every Harbor run failed"
    if harbor_failures:
        out["harbor_failures"] = harbor_failures
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", type=Path, default=DEFAULT_TASK, help="a task directory with solution/ and tests/")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    ap.add_argument("--no-harbor", action="store_true")
    ap.add_argument("--baseline", type=Path, help="another tmax checkout to time the same way (e.g. before a change)")
    args = ap.parse_args()
    out = measure(args.task.resolve(), args.runs, not args.no_harbor, args.baseline.resolve() if args.baseline else None)
    record_result(args, out)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['task']}: median of {out['runs']} (load average {out['load_avg']} on {out['cpus']} cpus)")
    print(f"  tmax     {out['tmax_s']:.2f} s")
    print(f"  floor    {out['floor_s']:.2f} s  (bare podman CLI)")
    print(f"  overhead {out['overhead_s']:.2f} s  (CPU: tmax {out['tmax_cpu_s']:.2f} s, floor {out['floor_cpu_s']:.2f} s)")
    if "baseline_s" in out:
        print(f"  baseline {out['baseline_s']:.2f} s  (overhead {out['baseline_overhead_s']:.2f} s)")
    if "harbor_s" in out:
        print(f"  harbor   {out['harbor_s']:.2f} s  ({out['harbor_ratio']:.1f}x tmax)")
    else:
        print(f"  harbor   skipped: {out['harbor_skipped']}")


if __name__ == "__main__":
    main()
