"""What a fork of a live podman episode costs (`sandbox.fork`), against getting the same state
the other way: a fresh episode replaying the prefix's commands.

The prefix is commands of a real task's solution: Terminal-Bench 2.0's cobol-modernization
(`../shared/tb2-sample`, read at run time, never edited), in its image built from tmax's base
image (`tasks.task_images.ensure_image`: built on first use, about a minute). Its solution's
commands that change the environment, the network's left out (the episode has none): write
the program's input data, build the COBOL program (`cobc`), write a Python port, run it
(which rewrites the data files). Depth 4 is those four, depth 1 the first, depth 16 the four
four times over (a longer episode that rebuilds and reruns). The same depths are also timed
with `true` as every command, where a replay costs next to nothing.

Per depth and round: (1) fresh + replay: an episode of a host already running (the best case
for replaying) and the prefix's commands in it; (2) fork: an episode that ran the prefix is
forked (`OverlayPool.fork`: its layers frozen, the child a new episode on them, its shell
given the parent's state); the parent's continuation, a new episode made at its next command,
is timed apart (parent_back: that command, `true`). Wall time and CPU seconds of this
process with its containers (a cpuacct cgroup of its own, where this process may make one:
root on cgroup v1; else the whole machine's, from /proc/stat). Each side ends with its state
compared to the parent's: the files under the task's workdir by content (sha256) and by
content, mode and mtime, the cwd and the exported variables. A fork is exact; a replay makes
the same contents where the commands are deterministic, and new mtimes.

    python benchmarks/fork_cost.py [--rounds 3] [--depths 1 4 16] [--json]

Run it under `flock /work/heavy.lock` on a shared machine; the figures are ratios measured
side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402
from podman_episode_profile import leave_cgroup, machine_cpu_s, own_cgroup  # noqa: E402

# The sample beside the checkout (`TMAX_TB2_SAMPLE` names another): the first `shared/tb2-sample`
# above this file.
SAMPLE = Path(os.environ.get("TMAX_TB2_SAMPLE") or next(
    (p / "shared" / "tb2-sample" for p in Path(__file__).resolve().parents if (p / "shared" / "tb2-sample").is_dir()),
    Path("../shared/tb2-sample")))
TASK = SAMPLE / "cobol-modernization"
# The solution's commands that only read (ls, cat FILE), move around (cd) or need the network.
_NOT_WORK = re.compile(r"(ls|cd|apt-get|cat\s+[^>]*$)(\s|$)")


def solution_commands(task_dir: Path) -> list[str]:
    """The top-level commands of the task's solve.sh, a heredoc kept with its command."""
    commands: list[str] = []
    lines = iter((task_dir / "solution" / "solve.sh").read_text().splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if m:
            body = [line]
            for more in lines:
                body.append(more)
                if more.strip() == m.group(1):
                    break
            commands.append("\n".join(body))
        else:
            commands.append(line.strip())
    return commands


def work_commands(task_dir: Path) -> list[str]:
    return [c for c in solution_commands(task_dir) if not _NOT_WORK.match(c)]


def prefix(work: list[str], depth: int) -> list[str]:
    return (work * (depth // len(work) + 1))[:depth]


_STATE = ("cd {wd} && find . -xdev -type f -exec sha256sum {{}} + | sort -k2 && echo @@meta &&"
          " find . -xdev -printf '%p %m %s %T@\\n' | sort")


def snapshot(sb, workdir: str) -> dict[str, str]:
    """What is compared: contents, contents with modes and mtimes, the shell's cwd and exports."""
    r = sb.exec(["sh", "-c", _STATE.format(wd=workdir)], timeout=120)
    contents, _, meta = r.output.partition("@@meta")
    shell = sb.run("pwd; export -p | grep -v -e ' PS1=' -e ' OLDPWD' | sort", timeout=60).output
    return {"contents": contents, "meta": meta, "shell": shell}


def same(a: dict[str, str], b: dict[str, str]) -> dict:
    """Whether `a` is `b`: by contents, and exactly; the files whose contents differ."""
    sums = [dict(reversed(line.split(None, 1)) for line in s["contents"].splitlines() if line.strip()) for s in (a, b)]
    differ = sorted(p for p in sums[0].keys() | sums[1].keys() if sums[0].get(p) != sums[1].get(p))
    return {"contents": a["contents"] == b["contents"], "exact": a == b, "differ": differ}


def measure(fn) -> tuple[object, float, float]:
    t0, c0 = time.monotonic(), machine_cpu_s()
    out = fn()
    return out, time.monotonic() - t0, machine_cpu_s() - c0


def one_round(pool, factory, commands: list[str], workdir: str) -> dict:
    def run_all(sb) -> None:
        for c in commands:
            r = sb.run(c, timeout=600)
            if r.timed_out:
                raise RuntimeError(f"{c[:60]!r} timed out")

    def replay():
        sb = pool.acquire("fork-cost", factory)
        run_all(sb)
        return sb

    replayed, replay_s, replay_cpu = measure(replay)
    parent = pool.acquire("fork-cost", factory)
    run_all(parent)
    before = snapshot(parent, workdir)
    forked, fork_s, fork_cpu = measure(lambda: pool.fork(parent))
    child = forked.sandbox
    _, back_s, back_cpu = measure(lambda: parent.run("true", timeout=60))  # the parent's continuation
    row = {"replay_s": replay_s, "replay_cpu_s": replay_cpu, "fork_s": fork_s, "fork_cpu_s": fork_cpu,
           "back_s": back_s, "back_cpu_s": back_cpu,
           "replay_same": same(snapshot(replayed, workdir), before), "fork_same": same(snapshot(child, workdir), before),
           "parent_after_fork_same": same(snapshot(parent, workdir), before)}
    for sb in (replayed, child, parent):
        pool.release(sb)
    return row


def summarize(rows: list[dict]) -> dict:
    keys = ("replay_s", "replay_cpu_s", "fork_s", "fork_cpu_s", "back_s", "back_cpu_s")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    return {
        "fork_ms": round(med["fork_s"] * 1000, 1), "fork_cpu_s": round(med["fork_cpu_s"], 3),
        "parent_back_ms": round(med["back_s"] * 1000, 1), "parent_back_cpu_s": round(med["back_cpu_s"], 3),
        "fresh_replay_ms": round(med["replay_s"] * 1000, 1), "fresh_replay_cpu_s": round(med["replay_cpu_s"], 3),
        "ratio_wall": round(med["fork_s"] / med["replay_s"], 3),
        "ratio_cpu": round(med["fork_cpu_s"] / max(med["replay_cpu_s"], 1e-6), 3),
        "replay_reproduced_contents": all(r["replay_same"]["contents"] for r in rows),
        "replay_exact": all(r["replay_same"]["exact"] for r in rows),
        "replay_files_differing": sorted({p for r in rows for p in r["replay_same"]["differ"]}),
        "fork_exact": all(r["fork_same"]["exact"] for r in rows),
        "parent_unchanged_by_fork": all(r["parent_after_fork_same"]["exact"] for r in rows),
        "rounds": len(rows),
    }


def run(depths: list[int], rounds: int) -> dict:
    from tmax.sandbox import SandboxSpec
    from tmax.sandbox.cleanup import remove_labelled
    from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory
    from tmax.tasks.task_images import ensure_image
    from tmax.tasks.task_format import Task
    from tmax.tasks.offline import default_config

    image = ensure_image(Task.load(TASK), default_config(), use_prebuilt=False)
    work = work_commands(TASK)
    factory = SpecFactory("podman", SandboxSpec(image=image.tag, workdir=image.workdir, memory_mb=2048, cpus=1.0))
    label = {"io.tmax.bench-fork": uuid.uuid4().hex[:12]}
    root = Path(tempfile.mkdtemp(prefix="tmax-fork-hosts-"))
    result: dict = {"task": TASK.name, "image": image.tag, "work_commands": [c.splitlines()[0] for c in work],
                    "machine": f"shared, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the start"}
    pool = OverlayPool(3, host_labels=label, root=root, close_in_background=False)
    try:
        pool.release(pool.acquire("fork-cost", factory))  # the host starts: not timed
        for kind, commands_of in (("task", lambda d: prefix(work, d)), ("trivial", lambda d: ["true"] * d)):
            for depth in depths:
                rows = [one_round(pool, factory, commands_of(depth), image.workdir) for _ in range(rounds)]
                result[f"{kind}_depth_{depth}"] = summarize(rows)
    finally:
        pool.close(in_use=True)
        remove_labelled(label)
    d4 = result.get("task_depth_4")
    if d4:
        result["target_depth_4_met"] = d4["ratio_wall"] <= 0.1 and d4["ratio_cpu"] <= 0.1
    result["load_at_end"] = round(os.getloadavg()[0], 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 4, 16])
    add_record_arguments(ap, __file__)
    args = ap.parse_args()
    cpu_source = own_cgroup()
    try:
        result = run(args.depths, args.rounds)
    finally:
        leave_cgroup()
    result["cpu_source"] = cpu_source
    record_result(args, result)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['task']} ({result['machine']}; CPU: {cpu_source})")
    for key, row in result.items():
        if isinstance(row, dict):
            print(f"  {key:16} fork {row['fork_ms']:8.1f} ms {row['fork_cpu_s']:6.3f} CPU s | fresh+replay "
                  f"{row['fresh_replay_ms']:8.1f} ms {row['fresh_replay_cpu_s']:6.3f} CPU s | ratio wall "
                  f"{row['ratio_wall']:.3f} CPU {row['ratio_cpu']:.3f} | replay exact {row['replay_exact']} "
                  f"(contents {row['replay_reproduced_contents']}), fork exact {row['fork_exact']}")


if __name__ == "__main__":
    main()
