"""Per-tool-call overhead: tmax's persistent shell vs a fresh process per command.

The reference approach (the Vanillux2 harness) runs every command as a new
`podman exec CID bash -c WRAPPER`, where the wrapper cds to the saved cwd, sources the
saved `export -p`, runs the command, saves `pwd` and `export -p` again and exits with
the command's code. tmax sends the command to one long-lived bash on a pty.

Both run the same 200 commands in the same container (then on the host and under
bwrap), and the outputs are compared so the two approaches provably do the same work.

    python benchmarks/shell_overhead.py [--n 200] [--json] [--image TAG] [--skip-bwrap]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

from tmax.sandbox import SandboxSpec, make_sandbox  # noqa: E402

STATE = "/tmp/.vanillux2"
SETUP = f"mkdir -p {STATE} && pwd > {STATE}/cwd && export -p > {STATE}/env"
WRAPPER = """cd "$(cat {s}/cwd)" 2>/dev/null
. {s}/env 2>/dev/null
{cmd}
__rc=$?
pwd > {s}/cwd
export -p > {s}/env
exit $__rc"""

# Typical agent commands; each depends only on cwd and exported variables, the state
# both approaches carry over, so their outputs must agree.
TEMPLATES = [
    "mkdir -p /tmp/bench/d{i} && cd /tmp/bench/d{i}",
    "export STEP={i} NAME=run{i}",
    "pwd",
    "echo \"$NAME $STEP\"",
    "echo 'hello {i}' > f{i}.txt && cat f{i}.txt",
    "ls /tmp/bench | wc -l",
    "test -f f{i}.txt && echo present || echo absent",
    "printf '%s\\n' c a b | sort",
    "false",
    "cd .. && pwd",
]


def commands(n: int) -> list[str]:
    return [TEMPLATES[i % len(TEMPLATES)].format(i=i) for i in range(n)]


def time_tmax(sb, cmds: list[str]) -> tuple[list[float], list[tuple[str, int]]]:
    sb.run("rm -rf /tmp/bench; cd /tmp")
    times, outs = [], []
    for c in cmds:
        t = time.perf_counter()
        r = sb.run(c, timeout=60)
        times.append(time.perf_counter() - t)
        outs.append((r.output, r.exit_code))
    return times, outs


def time_reference(prefix: list[str], cmds: list[str]) -> tuple[list[float], list[tuple[str, int]]]:
    """A fresh `<prefix> bash -c WRAPPER` per command; state only via the saved files."""
    subprocess.run(prefix + ["bash", "-c", f"rm -rf /tmp/bench {STATE}; cd /tmp && {SETUP}"], check=True,
                   capture_output=True)
    times, outs = [], []
    for c in cmds:
        t = time.perf_counter()
        p = subprocess.run(prefix + ["bash", "-c", WRAPPER.format(s=STATE, cmd=c)], capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        outs.append((p.stdout + p.stderr, p.returncode))
    return times, outs


def time_reference_api(container, cmds: list[str]) -> list[float]:
    """The same wrapper through the REST API (podman-py `exec_run`), for comparison."""
    container.exec_run(["bash", "-c", f"rm -rf /tmp/bench {STATE}; cd /tmp && {SETUP}"], demux=True)
    times = []
    for c in cmds:
        t = time.perf_counter()
        container.exec_run(["bash", "-c", WRAPPER.format(s=STATE, cmd=c)], demux=True)
        times.append(time.perf_counter() - t)
    return times


def ms(xs: list[float]) -> float:
    return round(statistics.mean(xs) * 1000, 3)


def mismatches(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> int:
    return sum(1 for x, y in zip(a, b) if x != y)


def bench_podman(image: str, cmds: list[str]) -> dict:
    sb = make_sandbox("podman", SandboxSpec(image=image))
    sb.start()
    try:
        cid = sb.container.id
        tmax_t, tmax_o = time_tmax(sb, cmds)
        ref_t, ref_o = time_reference(["podman", "exec", cid], cmds)
        api_t = time_reference_api(sb.container, cmds)
        return {
            "tmax_podman_ms": ms(tmax_t), "reference_podman_ms": ms(ref_t),
            "reference_podman_api_ms": ms(api_t),
            "podman_ratio": round(statistics.mean(ref_t) / statistics.mean(tmax_t), 1),
            "podman_api_ratio": round(statistics.mean(api_t) / statistics.mean(tmax_t), 1),
            "tmax_podman_p50_ms": round(statistics.median(tmax_t) * 1000, 3),
            "reference_podman_p50_ms": round(statistics.median(ref_t) * 1000, 3),
            "podman_output_mismatches": mismatches(tmax_o, ref_o),
            "tmax_podman_start_s": round(sb.shell.start_s, 3),
        }
    finally:
        sb.close()


def bench_local(cmds: list[str]) -> dict:
    sb = make_sandbox("local", SandboxSpec(workdir="/tmp"))
    sb.start()
    try:
        tmax_t, tmax_o = time_tmax(sb, cmds)
    finally:
        sb.close()
    ref_t, ref_o = time_reference([], cmds)
    return {"tmax_local_ms": ms(tmax_t), "reference_local_ms": ms(ref_t),
            "local_ratio": round(statistics.mean(ref_t) / statistics.mean(tmax_t), 1),
            "local_output_mismatches": mismatches(tmax_o, ref_o)}


def bench_bwrap(cmds: list[str]) -> dict:
    sb = make_sandbox("bwrap", SandboxSpec(workdir="/tmp"))
    sb.start()
    try:
        tmax_t, tmax_o = time_tmax(sb, cmds)
        # The reference gets the same jail, one bwrap per command, sharing /tmp.
        prefix = sb.bwrap_argv(sb._env(), "/tmp")
        ref_t, ref_o = time_reference(prefix, cmds)
    finally:
        sb.close()
    return {"tmax_bwrap_ms": ms(tmax_t), "reference_bwrap_ms": ms(ref_t),
            "bwrap_ratio": round(statistics.mean(ref_t) / statistics.mean(tmax_t), 1),
            "bwrap_output_mismatches": mismatches(tmax_o, ref_o)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="commands per approach")
    ap.add_argument("--image", default="localhost/tmax-base:bookworm")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    add_record_arguments(ap, __file__)
    ap.add_argument("--skip-bwrap", action="store_true")
    ap.add_argument("--skip-local", action="store_true")
    args = ap.parse_args()
    cmds = commands(args.n)
    res: dict = {"commands": len(cmds)}
    res.update(bench_podman(args.image, cmds))
    if not args.skip_local:
        res.update(bench_local(cmds))
    if not args.skip_bwrap and shutil.which("bwrap"):
        res.update(bench_bwrap(cmds))
    record_result(args, res)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"per-call latency over {len(cmds)} commands (mean ms; ratio = reference / tmax)")
    print(f"{'backend':<8} {'tmax':>10} {'reference':>10} {'ratio':>8} {'mismatch':>9}")
    for kind in ("podman", "local", "bwrap"):
        if f"tmax_{kind}_ms" in res:
            print(f"{kind:<8} {res[f'tmax_{kind}_ms']:>10.3f} {res[f'reference_{kind}_ms']:>10.3f}"
                  f" {res[f'{kind}_ratio']:>8.1f} {res[f'{kind}_output_mismatches']:>9d}")
    print(f"podman reference via REST exec_run: {res['reference_podman_api_ms']:.3f} ms"
          f" (ratio {res['podman_api_ratio']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
