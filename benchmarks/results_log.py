"""Every benchmark's `--record`: its result, the object `--json` prints, appended as one JSON
line to `docs/results/<benchmark>.jsonl`, with when, on which commit and machine, and the
exact command line. The per-run history lives there, written by the benchmarks themselves;
docs/RESULTS.md shows the headline figures and docs/results/notebook.md the hand-written
record up to 2026-12-07.

    ap = argparse.ArgumentParser(...)
    add_record_arguments(ap, __file__)
    ...
    record_result(args, out)        # with --record, whether or not --json was given

`--record-dir DIR` writes the same line to DIR/<benchmark>.jsonl instead (a scratch run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field

from tmax.common.files import append_line_atomic

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "results"


class Machine(BaseModel):
    """What the run ran on: the figures of a 2-core VM and of an 8-GPU node do not compare."""

    cpu_model: Annotated[str, Field(description="the CPU's model name (/proc/cpuinfo), else the platform's")]
    cores: Annotated[int, Field(description="logical CPUs the OS reports (os.cpu_count)")]
    memory_gib: Annotated[float, Field(description="physical memory, GiB")]
    gpus: Annotated[list[str], Field(description="GPU names from nvidia-smi; empty where there is none")] = []
    load_average: Annotated[list[float], Field(description="1, 5 and 15 minute load when the result was recorded")]


class ResultRecord(BaseModel):
    """One line of docs/results/<benchmark>.jsonl."""

    benchmark: Annotated[str, Field(description="the script's name, e.g. nano_recipe")]
    date: Annotated[str, Field(description="when the result was recorded, ISO 8601 UTC")]
    commit: Annotated[str | None, Field(description="`git rev-parse HEAD` of the checkout; None outside git")]
    dirty: Annotated[bool, Field(description="tracked files differed from the commit")]
    machine: Machine
    argv: Annotated[list[str], Field(description="sys.argv exactly as the benchmark got it")]
    result: Annotated[dict[str, Any], Field(description="the object the benchmark's --json prints")]


def add_record_arguments(parser: argparse.ArgumentParser, script: str) -> None:
    """`--record` and `--record-dir` on a benchmark's parser; `script` is its `__file__`."""
    name = Path(script).stem
    parser.add_argument("--record", action="store_true",
                        help=f"append the result (what --json prints) as one line to docs/results/{name}.jsonl, "
                             "with date, commit, machine and this command line")
    parser.add_argument("--record-dir", type=Path, default=RESULTS_DIR,
                        help="with --record: write DIR/<benchmark>.jsonl instead of docs/results/")
    parser.set_defaults(record_benchmark=name)


def record_result(args: argparse.Namespace, result: dict[str, Any]) -> Path | None:
    """With `--record`, append `result` to <record-dir>/<benchmark>.jsonl and say so on stderr
    (stdout stays the benchmark's own); returns the file, or None without `--record`."""
    if not args.record:
        return None
    rec = make_record(args.record_benchmark, result, sys.argv)
    path = Path(args.record_dir) / f"{rec.benchmark}.jsonl"
    append_line_atomic(path, rec.model_dump_json())
    print(f"recorded in {path}", file=sys.stderr, flush=True)
    return path


def make_record(benchmark: str, result: dict[str, Any], argv: list[str]) -> ResultRecord:
    commit, dirty = _git_state()
    return ResultRecord(benchmark=benchmark, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        commit=commit, dirty=dirty, machine=this_machine(), argv=list(argv), result=result)


def read_records(path: Path) -> list[ResultRecord]:
    """The records of one benchmark's file, oldest first; a line that is not one (cut short
    by a crash) raises ValueError naming the file and line."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(ResultRecord.model_validate_json(line))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a result record: {e}") from None
    return out


def this_machine() -> Machine:
    return Machine(cpu_model=_cpu_model(), cores=os.cpu_count() or 0, memory_gib=_memory_gib(), gpus=_gpus(),
                   load_average=[round(x, 2) for x in os.getloadavg()])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    return [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.returncode == 0 else []


def _git_state() -> tuple[str | None, bool]:
    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=30)

    if not shutil.which("git"):
        return None, False
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return None, False
    status = git("status", "--porcelain", "--untracked-files=no")
    return head.stdout.strip(), bool(status.stdout.strip())
