"""Cost per step of undo snapshots (`tmax run --undo-steps N`), side by side with no undo.

Each sandbox runs the same small edit command N times: once plain, once with a snapshot
taken before every command (`sandbox.snapshot.UndoHistory`, the last 5 kept), exactly as
`tmax run` does. The workspace (local, bwrap) holds `--files` files of `--kb` KiB each;
the container (podman) gets the same files under /root/work, so the diff-based snapshots
archive them each step. For podman, `podman commit` (the alternative that was rejected)
is timed on the same container for comparison.

    python benchmarks/undo_cost.py [--steps 20] [--files 200] [--kb 16] [--skip-podman] [--skip-bwrap]
    python benchmarks/undo_cost.py --json [--sandbox bwrap] [--steps 20]

`--json` measures one sandbox (bwrap where it works, else local) on a small tree (200 files,
3.1 MiB) and a large one (20,000 files, 270 MB, like a real repository with its build
outputs) and prints milliseconds per command with undo on and off: small_ms_on,
small_ms_off, large_ms_on, large_ms_off (medians), plus the one-off cost of starting undo
(setup_ms: the mirror of the tree) and of one restore.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

from tmax.sandbox import SandboxSpec, make_sandbox  # noqa: E402
from tmax.sandbox.snapshot import UndoHistory, snapshot_store  # noqa: E402

KEEP = 5


def _fill(run, files: int, kb: int, where: str) -> None:
    run(f"mkdir -p {where} && cd {where} && for i in $(seq 1 {files}); do head -c {kb * 1024} /dev/urandom > f$i.bin; done")


def _steps(box, n: int, history: UndoHistory | None) -> list[float]:
    times = []
    for i in range(n):
        cmd = f"echo step {i} >> log.txt && cp f1.bin copy{i % 3}.bin"
        t0 = time.perf_counter()
        if history is not None:
            history.before(cmd)
        r = box.run(cmd, timeout=60)
        times.append((time.perf_counter() - t0) * 1000)
        assert r.exit_code == 0, r.output
    return times


def _commit_ms(box, n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        r = subprocess.run(["podman", "commit", "-q", box.container.id, f"localhost/tmax-undo-bench:{i}"],
                           capture_output=True, text=True)
        times.append((time.perf_counter() - t0) * 1000)
        assert r.returncode == 0, r.stderr
    subprocess.run(["podman", "rmi", "-f", *[f"localhost/tmax-undo-bench:{i}" for i in range(n)]], capture_output=True)
    return statistics.median(times)


def _host_tree(root: Path, files: int, kb: float) -> None:
    """files of kb KiB each, 100 to a directory (a repository's shape, not one flat folder)."""
    size = int(kb * 1024)
    for i in range(files):
        d = root / f"d{i // 100}"
        if i % 100 == 0:
            d.mkdir()
        (d / f"f{i}.bin").write_bytes(os.urandom(size))
    (root / "f1.bin").write_bytes(os.urandom(size))


def measure(kind: str, args, files: int | None = None, kb: float | None = None) -> dict[str, float]:
    files, kb = files or args.files, kb or args.kb
    ws = Path(tempfile.mkdtemp(prefix="tmax-undo-bench-", dir=args.dir))
    spec = SandboxSpec(workdir=str(ws)) if kind == "local" else SandboxSpec(workspace=ws) if kind == "bwrap" else SandboxSpec()
    box = make_sandbox(kind, spec)
    box.start()
    try:
        where = "/root/work" if kind == "podman" else str(ws if kind == "local" else box.target)
        if kind == "podman":
            _fill(lambda c: box.run(c, timeout=600), files, int(kb), where)
        else:
            _host_tree(ws, files, kb)
        box.run(f"cd {where}", timeout=10)
        plain = _steps(box, args.steps, None)
        t0 = time.perf_counter()
        history = UndoHistory(snapshot_store(box), KEEP)
        setup_ms = (time.perf_counter() - t0) * 1000
        try:
            undo = _steps(box, args.steps, history)
            t0 = time.perf_counter()
            history.undo(1)
            restore_ms = (time.perf_counter() - t0) * 1000
        finally:
            history.close()
        row = {"plain_ms": statistics.median(plain), "undo_ms": statistics.median(undo), "restore_ms": restore_ms,
               "setup_ms": setup_ms}
        if kind == "podman":
            row["commit_ms"] = _commit_ms(box, min(args.steps, 5))
        return row
    finally:
        box.close()
        shutil.rmtree(ws, ignore_errors=True)


SMALL = (200, 16)  # files, KiB each: 3.1 MiB
LARGE = (20_000, 13.5)  # 270 MB


def measure_sizes(args) -> dict[str, float | str]:
    from tmax.cli.run_settings import bwrap_works

    kind = args.sandbox or ("bwrap" if bwrap_works() else "local")
    out: dict[str, float | str] = {"sandbox": kind, "steps": args.steps}
    for name, (files, kb) in (("small", SMALL), ("large", LARGE)):
        r = measure(kind, args, files, kb)
        out.update({f"{name}_ms_on": round(r["undo_ms"], 1), f"{name}_ms_off": round(r["plain_ms"], 1),
                    f"{name}_setup_ms": round(r["setup_ms"]), f"{name}_restore_ms": round(r["restore_ms"])})
    out["large_on_minus_off_ms"] = round(out["large_ms_on"] - out["large_ms_off"], 1)  # type: ignore[operator]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--files", type=int, default=200)
    p.add_argument("--kb", type=int, default=16)
    p.add_argument("--skip-podman", action="store_true")
    p.add_argument("--skip-bwrap", action="store_true")
    p.add_argument("--json", action="store_true", help="small and large tree on one sandbox, as one JSON object")
    add_record_arguments(p, __file__)
    p.add_argument("--sandbox", choices=["local", "bwrap"], default=None, help="with --json (default: bwrap where it works)")
    p.add_argument("--dir", default=None, help="where the workspaces are made (default: the temp directory)")
    args = p.parse_args()
    if args.json:
        out = measure_sizes(args)
        record_result(args, out)
        print(json.dumps(out))
        return
    kinds = ["local"] + ([] if args.skip_bwrap else ["bwrap"]) + ([] if args.skip_podman else ["podman"])
    mib = args.files * args.kb / 1024
    print(f"{args.steps} steps, workspace {args.files} files x {args.kb} KiB = {mib:.1f} MiB; medians per step")
    print(f"{'sandbox':8} {'no undo':>10} {'with undo':>10} {'snapshot':>10} {'ratio':>7} {'1 restore':>10} {'podman commit':>14}")
    by_sandbox = {}
    for kind in kinds:
        r = by_sandbox[kind] = measure(kind, args)
        commit = f"{r['commit_ms']:.0f} ms" if "commit_ms" in r else "-"
        print(f"{kind:8} {r['plain_ms']:>7.1f} ms {r['undo_ms']:>7.1f} ms {r['undo_ms'] - r['plain_ms']:>7.1f} ms "
              f"{r['undo_ms'] / r['plain_ms']:>6.1f}x {r['restore_ms']:>7.0f} ms {commit:>14}")
    # Without --json there is no one object to print: the record holds each sandbox's figures.
    record_result(args, {"steps": args.steps, "files": args.files, "kb": args.kb, "by_sandbox": by_sandbox})


if __name__ == "__main__":
    main()
