"""What starting and closing a sandbox shell costs a large driver: pexpect's spawn (a fork
of the whole driver, what tmax used) against `sandbox.ptyspawn` (pty set up here, the child
started through Popen's vfork path), both driving the same `bash --norc` through one
command and a close.

The driver imports torch and holds --resident-mb of written memory, as the recipe's driver
does after SFT. Rounds alternate between the two ways; the medians are printed.

    python benchmarks/shell_spawn.py [--shells 40] [--rounds 3] [--resident-mb 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

import pexpect  # noqa: E402

from tmax.sandbox.ptyspawn import PtyProcess  # noqa: E402

ENV = dict(os.environ, TERM="dumb", PS1="", PS2="")


def _read_until(read, marker: bytes) -> None:
    buf = b""
    while marker not in buf:
        buf += read()


def with_pexpect() -> None:
    child = pexpect.spawn("bash", ["--norc", "--noprofile"], env=ENV, echo=False, timeout=None,
                          dimensions=(50, 200), use_poll=True)
    child.delaybeforesend = None
    child.send(b"echo ready-$((40+2))\n")
    _read_until(lambda: child.read_nonblocking(4096, timeout=30), b"ready-42")
    child.close(force=True)


def with_ptyspawn() -> None:
    child = PtyProcess(["bash", "--norc", "--noprofile"], ENV)
    child.send(b"echo ready-$((40+2))\n")
    _read_until(lambda: child.read_nonblocking(4096, timeout=30), b"ready-42")
    child.close()


def measure(fn, shells: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(shells):
        fn()
    return {"wall_ms": (time.perf_counter() - wall) / shells * 1e3,
            "driver_cpu_ms": (time.process_time() - cpu) / shells * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shells", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--resident-mb", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    import torch

    ballast = torch.ones(args.resident_mb * 2**20 // 4)  # written, so resident
    rounds: dict[str, list[dict]] = {"pexpect": [], "ptyspawn": []}
    for _ in range(args.rounds):
        rounds["pexpect"].append(measure(with_pexpect, args.shells))
        rounds["ptyspawn"].append(measure(with_ptyspawn, args.shells))
    med = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("wall_ms", "driver_cpu_ms")}
           for k, v in rounds.items()}
    out = {"resident_mb": args.resident_mb, "shells_per_round": args.shells, "median": med,
           "wall_pexpect_over_ptyspawn": round(med["pexpect"]["wall_ms"] / med["ptyspawn"]["wall_ms"], 1),
           "cpu_pexpect_over_ptyspawn": round(med["pexpect"]["driver_cpu_ms"] / med["ptyspawn"]["driver_cpu_ms"], 1)}
    del ballast
    record_result(args, out)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in med.items():
            print(f"{k:9s} {v['wall_ms']:7.1f} ms a shell, driver CPU {v['driver_cpu_ms']:6.1f} ms")
        print(f"pexpect / ptyspawn: wall {out['wall_pexpect_over_ptyspawn']}x, "
              f"driver CPU {out['cpu_pexpect_over_ptyspawn']}x")


if __name__ == "__main__":
    main()
