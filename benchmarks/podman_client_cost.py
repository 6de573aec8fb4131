"""What a podman call costs through each client tmax could use for everything: podman-py
against the REST service, and the podman CLI as a client of that same service (`--url`),
side by side in one run, alternating, each repeated.

The operations are the ones an episode makes: ask whether a container exists, a one-off
exec (`true`, the harness's setup and verifier execs), and a container's whole life (create,
start, remove) from the base image. For each: wall seconds per call and the CPU seconds of
this process and its children per call (the CLI's process start lands there; the service's
own work, the same for both, does not).

    python benchmarks/podman_client_cost.py [--rounds N] [--image IMAGE] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402
from tmax.sandbox import podman_service  # noqa: E402
from tmax.sandbox.base import LABEL_KEY, LABEL_VALUE  # noqa: E402
from tmax.sandbox.base_image import DEFAULT_BASE_TAG as DEFAULT_IMAGE  # noqa: E402
from tmax.sandbox.podman import DEFAULT_ULIMITS  # noqa: E402

LABEL = {LABEL_KEY: LABEL_VALUE, "io.tmax.bench": "podman-client-cost"}
# As every tmax container has them (the service's defaults exceed this machine's hard nofile).
ULIMITS = [{"Name": k, "Soft": soft, "Hard": hard} for k, (soft, hard) in DEFAULT_ULIMITS.items()]
CLI_ULIMITS = [a for k, (soft, hard) in DEFAULT_ULIMITS.items() for a in ("--ulimit", f"{k}={soft}:{hard}")]


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    t0, c0 = time.monotonic(), _cpu_s()
    fn()
    return time.monotonic() - t0, _cpu_s() - c0


def _cli(url: str, *args: str) -> str:
    r = subprocess.run(["podman", "--url", url, *args], capture_output=True, text=True, timeout=120)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"podman {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


def operations(url: str, image: str, client, cid: str) -> dict[str, dict[str, Callable[[], object]]]:
    """Per operation, the call through each client."""
    ct = client.containers.get(cid)

    def rest_life() -> None:
        c = client.containers.create(image, ["sleep", "infinity"], labels=LABEL, network_mode="none", ulimits=ULIMITS,
                                     stop_signal=9)  # as tmax's containers: a forced remove kills at once
        c.start()
        c.remove(force=True)

    def cli_life() -> None:
        new = _cli(url, "create", "--label", f"{LABEL_KEY}={LABEL_VALUE}", "--label", "io.tmax.bench=podman-client-cost",
                   "--network", "none", "--stop-signal", "9", *CLI_ULIMITS, image, "sleep", "infinity")
        _cli(url, "start", new)
        _cli(url, "rm", "-f", new)

    return {
        "exists": {"podman-py": lambda: client.containers.exists(cid), "cli": lambda: _cli(url, "container", "exists", cid)},
        "exec": {"podman-py": lambda: ct.exec_run(["true"], demux=True), "cli": lambda: _cli(url, "exec", cid, "true")},
        "container_life": {"podman-py": rest_life, "cli": cli_life},
    }


def measure(rounds: int, image: str) -> dict[str, dict[str, dict[str, float]]]:
    url = podman_service.service_url()
    with podman_service.client() as client:
        main = client.containers.create(image, ["sleep", "infinity"], labels=LABEL, network_mode="none", ulimits=ULIMITS,
                                        stop_signal=9)
        try:
            main.start()
            ops = operations(url, image, client, main.id)
            samples: dict[str, dict[str, list[tuple[float, float]]]] = {op: {k: [] for k in ways} for op, ways in ops.items()}
            for op, ways in ops.items():
                for way in ways.values():  # one unmeasured call each: connections, caches
                    way()
                n = rounds if op != "container_life" else max(2, rounds // 4)
                for _ in range(n):
                    for name, way in ways.items():  # alternating: the machine's load falls on both
                        samples[op][name].append(_timed(way))
        finally:
            main.remove(force=True)
    return {op: {name: {"wall_ms": round(1000 * statistics.median(w for w, _ in s), 1),
                        "client_cpu_ms": round(1000 * statistics.mean(c for _, c in s), 1), "n": len(s)}
                 for name, s in ways.items()} for op, ways in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--image", default=DEFAULT_IMAGE)
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    a = ap.parse_args()
    result = measure(a.rounds, a.image)
    record_result(a, result)
    if a.json:
        print(json.dumps(result, indent=2))
        return
    for op, ways in result.items():
        rest, cli = ways["podman-py"], ways["cli"]
        print(f"{op:15s} podman-py {rest['wall_ms']:7.1f} ms ({rest['client_cpu_ms']:5.1f} ms cpu)   "
              f"cli --url {cli['wall_ms']:7.1f} ms ({cli['client_cpu_ms']:5.1f} ms cpu)   "
              f"cli/podman-py wall x{cli['wall_ms'] / max(rest['wall_ms'], 0.1):.1f}  (n={rest['n']})")


if __name__ == "__main__":
    main()
