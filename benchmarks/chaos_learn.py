"""A chaos run of `tmax learn`: every part killed on a seeded schedule, then the driver
SIGKILLed and the run resumed; prints what was injected, detected and recovered.

    python benchmarks/chaos_learn.py --json                      # nano-podman, every fault
    python benchmarks/chaos_learn.py --json --preset nano        # host sandboxes (no containers)
    python benchmarks/chaos_learn.py --json --short              # one of each but the learner
    python benchmarks/chaos_learn.py --json --model DIR          # from a nano checkpoint, no SFT first
    python benchmarks/chaos_learn.py --json --learner-ranks 2    # two learner ranks (FSDP over gloo)
    python benchmarks/chaos_learn.py --json --lora-rank 8        # RL trains a LoRA adapter; engines serve it

A fresh nano model and generated tasks; the driver is `python -m tmax.cli.main learn` in its
own process, so it can be SIGKILLed. While it runs, this script kills, after a step has
finished: task containers (`--container-kills`, podman only; each one of the run's
containers while episodes that have just begun run in it, preferring one that holds
several: episodes are overlays of shared containers), and at seeded moments the vLLM server process, a rollout
worker actor process and the learner rank process (the driver then stops; the run is
resumed), and finally the driver itself with SIGKILL (resumed again).
The last driver finishes the run's steps. With `--learner-ranks N` the learner is N ranks
on this machine: one of them is killed, the whole group stops, and the resumed driver forms
a new one. With `--lora-rank R` the run trains a LoRA adapter: a restarted engine starts on
the run's start adapter and loads the last one pushed (`adapter_reloads` counts the engine
starts that did, from the engine's log), and resumed drivers continue the adapter checkpoint.

Per fault kind: injected, detected (the run noticed: a container's episodes re-queued, or
none scored that ran a command in it; a new engine or worker process in place of the killed
one, Ray having restarted the actor; the driver stopped with the learner's error; a killed
driver counts as detected, its successor being started with --resume), recovered (a step
finished after it, in the same or the resumed driver), seconds to recover and episodes
re-queued (and for a container, the episodes running in it when it was killed). Checks:
`infra_rewards_in_loss` (scored episodes that ran commands in a killed container: must be 0),
`duplicate_groups_in_loss` (an episode recorded twice: must be 0), `steps_lost` (steps
trained twice because a driver died after them and before their checkpoint),
`leftover_containers` / `leftover_processes` after the last driver (must be 0).
Timings come from a machine shared with other work: compare, do not quote as absolutes.
With `--branching` every episode forks after its first turn into two branches
(`[rollout.branching]`), so a killed container holds branches: a branch it ends is a labelled
failure (`env/infra_errors/branch_*`, counted as detected), never scored, and an episode
that loses every branch is re-queued; an episode recorded twice counts its leaves apart.
A fork failing halfway, and a host killed during forks, are `chaos_fork.py`'s (the sandbox
layer's faults, without a trainer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402

TAG_ENV = "TMAX_CHAOS_RUN"  # every process of the run inherits it: how its processes are found
# What each kind of fault kills (a process command-line needle; containers by run label).
TARGETS = {"engine": "vllm_cpu_main.py", "worker": "ray::RolloutWorker", "learner": "ray::LearnerRank"}
# How long a killed actor's successor may take to appear (a vLLM server on CPU starts in ~1 min).
RESTART_WAIT_S = 300.0
# Processes of the run that must be gone once its last driver ended.
RUN_PROCESSES = ("vllm_cpu_main.py", "VLLM::EngineCore", "procguard.py", "ray::", "raylet", "gcs_server")


@dataclass
class Fault:
    kind: str
    injected: bool = False
    detected: bool = False
    recovered: bool = False
    seconds_to_recover: float | None = None
    episodes_requeued: int = 0
    episodes_in_target: int = 0  # a container fault: episodes running in the container when it was killed
    target: str = ""
    t_inject: float = 0.0
    rows_before: int = 0
    requeued_before: float = 0.0


@dataclass
class Chaos:
    run: Path
    cfg: Path
    tag: str
    log: Path
    step_wait_s: float = 1800.0  # the longest wait for a step (or the run) to finish
    drivers: list = field(default_factory=list)
    # container id -> when it was killed (epoch s): a container serves many episodes (episodes
    # are overlays of shared containers), those that ended before its kill were its own work
    killed_containers: dict = field(default_factory=dict)
    steps_lost: int = 0  # steps a killed driver logged past the checkpoint its successor resumed from

    # -- the driver --------------------------------------------------------------------

    def resume(self) -> subprocess.Popen:
        """A driver with --resume; first the steps the dead one logged past its last
        complete checkpoint (trained again by the resumed run) are counted as lost."""
        from tmax.training.learner import checkpoint as ckpt

        last = ckpt.latest_checkpoint(self.run)
        at = int(ckpt.load_trainer_state(last)["step"]) if last else 0
        self.steps_lost += max([0] + [int(r["step"]) - at for r in self.rows()])
        return self.start_driver(resume=True)

    def start_driver(self, resume: bool) -> subprocess.Popen:
        argv = [sys.executable, "-m", "tmax.cli.main", "learn", "-c", str(self.cfg), "-o", str(self.run),
                "--no-progress"] + (["--resume"] if resume else [])
        env = {**os.environ, TAG_ENV: self.tag, "PYTHONPATH": str(ROOT)}
        out = open(self.log, "a")
        out.write(f"\n==== driver {len(self.drivers) + 1} {'--resume' if resume else ''}\n")
        out.flush()
        # SIGINT as a terminal's (this script may run in the background, SIGINT ignored): the
        # way every driver left at the end is stopped.
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.drivers.append(p)
        return p

    def rows(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
        return out

    def wait_rows(self, n: int, driver: subprocess.Popen) -> bool:
        """Until metrics.jsonl has `n` rows; False if the driver ended first or time ran out.
        Polled often: a short run's steps can take well under a second."""
        deadline = time.monotonic() + self.step_wait_s
        while time.monotonic() < deadline:
            if len(self.rows()) >= n:
                return True
            if driver.poll() is not None:
                return len(self.rows()) >= n
            time.sleep(0.1)
        return False

    @contextlib.contextmanager
    def paused(self, driver: subprocess.Popen):
        """The driver stopped (SIGSTOP) while a fault is chosen and injected: it starts no
        step meanwhile, so a run whose steps take half a second (a random policy on a fast
        machine) cannot finish before its faults. Its actors keep running, so the fault
        still lands in the middle of their work."""
        driver.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            if driver.poll() is None:
                driver.send_signal(signal.SIGCONT)

    # -- the run's processes and containers --------------------------------------------

    def processes(self, needle: str) -> list:
        """The run's processes whose command line holds `needle`; the guard that runs a vLLM
        server (its command line holds the server's) counts only when named itself."""
        import psutil

        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            text = " ".join(p.info["cmdline"] or [])
            if needle not in text or ("procguard.py" in text and "procguard.py" not in needle):
                continue
            try:
                if p.environ().get(TAG_ENV) == self.tag:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def containers(self) -> list[str]:
        from tmax.training.rollout import run_labels

        [(key, value)] = run_labels(self.run).items()
        r = subprocess.run(["podman", "ps", "-q", "--no-trunc", "--filter", f"label={key}={value}"],
                           capture_output=True, text=True)
        return r.stdout.split()


def _requeued(rows: list[dict]) -> float:
    """Episodes re-queued so far, and branches lost (`--branching`: a branch a fault ended is
    dropped, its siblings go on)."""
    if not rows:
        return 0.0
    lost = sum(v for k, v in rows[-1].items() if k.startswith("env/infra_errors/branch_"))
    return float(rows[-1].get("infra/requeued", 0.0)) + float(lost)


def _inject(chaos: Chaos, fault: Fault, rng: random.Random) -> bool:
    """Kill the fault's target process; False when there was none to kill within a minute."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        procs = chaos.processes(TARGETS[fault.kind])
        if procs:
            p = rng.choice(procs)
            fault.target = f"pid {p.pid}"
            p.send_signal(signal.SIGKILL)
            return True
        time.sleep(0.5)
    return False


def _episodes_by_container(max_age_s: float) -> dict[str, int]:
    """Container id -> episodes that began in it at most `max_age_s` ago and still run: the
    live episode sockets of each overlay host on this machine (`sandbox.overlay_pool`), read
    from files, no podman call. Young ones, because an older one may be past its verifier and
    closing, its result already in: killing its container then takes nothing from the run."""
    from tmax.sandbox.overlay import HostInfo
    from tmax.sandbox.overlay_pool import HostRegistry

    out: dict[str, int] = {}
    now = time.time()
    for d in HostRegistry().root.glob("*/h-*"):
        info = HostInfo.load(d)
        if info is None:
            continue
        young = 0
        for sock in d.glob("ep-*.sock"):
            try:
                young += now - sock.stat().st_mtime <= max_age_s
            except OSError:
                pass  # ended meanwhile
        out[info.container_id] = young
    return out


def _kill_busy_container(chaos: Chaos, fault: Fault, driver: subprocess.Popen, wait_s: float = 180.0,
                         max_age_s: float = 0.5) -> bool:
    """SIGKILL a container of the run while episodes that began in it at most `max_age_s` ago
    run there (several, if that comes within the first half of `wait_s`): each must then be
    re-queued, not scored. Recorded just before the kill: the rows and re-queues so far.
    False when no container of the run held such an episode in time."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and driver.poll() is None:
        want = 2 if deadline - time.monotonic() > wait_s / 2 else 1
        busy = {c: n for c, n in _episodes_by_container(max_age_s).items()
                if n >= want and c not in chaos.killed_containers}
        ours = set(chaos.containers()) if busy else set()
        busy = {c: n for c, n in busy.items() if c in ours}
        if busy:
            cid = max(busy, key=lambda c: (busy[c], c))
            rows = chaos.rows()
            fault.rows_before, fault.requeued_before = len(rows), _requeued(rows)
            fault.t_inject = time.monotonic()
            subprocess.run(["podman", "kill", cid], capture_output=True)
            chaos.killed_containers[cid] = time.time()
            fault.target, fault.episodes_in_target = cid[:12], busy[cid]
            return True
        time.sleep(0.05)
    return False


def _in_driver_faults(chaos: Chaos, driver: subprocess.Popen, faults: list[Fault], rng: random.Random) -> None:
    """Faults the running driver must survive: each injected after a step (a process at a
    seeded moment, a container once episodes run in it), recovered when a later step finishes."""
    for f in faults:
        if not chaos.wait_rows(len(chaos.rows()) + (1 if f is faults[0] else 0), driver):
            return
        before: set[int] = set()
        if f.kind == "container":  # the driver runs on: only it starts the episodes the kill must hit
            f.injected = _kill_busy_container(chaos, f, driver)
        else:
            with chaos.paused(driver):
                time.sleep(rng.uniform(0.0, 3.0))
                rows = chaos.rows()
                f.rows_before, f.requeued_before = len(rows), _requeued(rows)
                f.t_inject = time.monotonic()
                before = {p.pid for p in chaos.processes(TARGETS[f.kind])}
                f.injected = _inject(chaos, f, rng)
        if not f.injected or not chaos.wait_rows(f.rows_before + 1, driver):
            continue
        f.recovered = True
        f.seconds_to_recover = round(time.monotonic() - f.t_inject, 1)
        rows = chaos.rows()
        f.episodes_requeued = int(_requeued(rows) - f.requeued_before)
        if f.kind == "container":  # its episodes were re-queued, or none needed it after the kill
            f.detected = f.episodes_requeued > 0 or _never_scored(chaos, f.target)
        else:  # episodes re-queued, or a new process (Ray restarted the actor) serves the run
            f.detected = f.episodes_requeued > 0 or _restarted(chaos, f.kind, before, driver)


def _restarted(chaos: Chaos, kind: str, before: set[int], driver: subprocess.Popen) -> bool:
    """A process of the kind that was not there before the kill appears while the driver
    runs. Waited for: the step after a kill can finish from episodes already sampled, before
    Ray has restarted the actor."""
    from tmax.common.waiting import wait_until

    def new_process() -> bool:
        return bool({p.pid for p in chaos.processes(TARGETS[kind])} - before)

    wait_until(lambda: new_process() or driver.poll() is not None, RESTART_WAIT_S, 0.5)
    return new_process()


def _never_scored(chaos: Chaos, short_id: str) -> bool:
    """No episode that ended after the kill ran a command in the container (one that ended on
    a format error before its first command never needed it; one that ended before the kill
    was done with it)."""
    [killed] = [t for c, t in chaos.killed_containers.items() if c.startswith(short_id)]
    return not any(_ran_after(r, short_id, killed) for r in _rollouts(chaos.run))


def _ran_after(r: dict, container: str, killed: float) -> bool:
    """A scored episode that ran commands in `container` and ended after `killed` (its
    `command_s` holds one round trip per command; `steps` counts model turns, and a turn
    that ended on a format error ran none)."""
    ended = r.get("started_at", 0.0) + r.get("timings", {}).get("total_s", 0.0)
    return (r.get("container_id") or "").startswith(container[:12]) and bool(r.get("command_s")) and ended > killed


def _rollouts(run: Path) -> list[dict]:
    path = run / "rollouts.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _driver_killing_fault(chaos: Chaos, driver: subprocess.Popen, kind: str, rng: random.Random,
                          steps: int) -> Fault:
    """The learner rank (the driver must stop with its error) or the driver (SIGKILL), at a
    seeded moment after the last fault's recovery (or the first step), while steps are left;
    then a resumed driver, recovered when it finishes a step."""
    f = Fault(kind)
    if not chaos.wait_rows(max(1, len(chaos.rows())), driver):
        return f
    with chaos.paused(driver):
        time.sleep(rng.uniform(0.0, 0.5))
        f.rows_before, f.requeued_before = len(chaos.rows()), _requeued(chaos.rows())
        if f.rows_before >= steps or driver.poll() is not None:
            return f  # the run ended first: not injected (more --steps)
        f.t_inject = time.monotonic()
        if kind == "driver":
            driver.send_signal(signal.SIGKILL)  # a stopped process dies all the same
            f.injected, f.target = True, f"pid {driver.pid}"
            driver.wait()
            f.detected = True  # nothing to detect: the next driver is started with --resume
        else:
            f.injected = _inject(chaos, f, rng)
    if kind != "driver" and f.injected:
        try:
            rc = driver.wait(timeout=600)
        except subprocess.TimeoutExpired:
            rc = None
        f.detected = rc not in (None, 0) and "learner died" in chaos.log.read_text()
    if f.injected:
        resumed = chaos.resume()
        if chaos.wait_rows(f.rows_before + 1, resumed):
            f.recovered = True
            f.seconds_to_recover = round(time.monotonic() - f.t_inject, 1)
    return f


def _warm_start(root: Path, tasks: list[str]) -> Path:
    """A few SFT steps on oracle demonstrations (host sandbox): enough for the policy to
    issue commands, so its episodes use their containers (a random model ends every
    episode on a format error before its first command, and a killed container would go
    unnoticed because nothing needed it)."""
    from transformers import AutoTokenizer

    from tmax.training.config import preset
    from tmax.training.demos import collect_demos
    from tmax.training.learner.sft import train_sft
    from tmax.training.nano.model import build_nano_model

    build_nano_model(root / "base")
    cfg = preset("nano")
    # 32 epochs of the 24 demonstrations: 96 steps, about 1.5 min of SFT. 6 epochs (18 steps,
    # loss 2.4) left a policy whose every episode ended on a format error before its first
    # command, so no container kill could hit an episode's work.
    cfg.sft.epochs, cfg.sft.teacher_accuracy = 32.0, 1.0
    demos = collect_demos(tasks, AutoTokenizer.from_pretrained(root / "base"), cfg)
    return Path(train_sft(str(root / "base"), demos, cfg, root / "sft").checkpoint)


BRANCHING = """[rollout.branching]
enabled = true
at_turns = [1]
branches = 2
"""


def _setup(root: Path, preset: str, steps: int, model: Path | None, learner_ranks: int, lora_rank: int = 0,
           branching: bool = False) -> Path:
    from tmax.training.nano.tasks import write_splits

    tasks = [str(d) for d in write_splits(root / "tasks", 24, 1)["train"]]
    model = model or _warm_start(root, tasks)
    cfg = root / "chaos.toml"
    # Rewards may all be equal: the zero-std filter is off so batches train, and the collapse
    # guard is off (the mechanics are under test, as in tests/integration/test_loop.py).
    cfg.write_text(f"""extends = "{preset}"
name = "chaos"
[model]
path = "{model}"
build_nano = false
[tasks]
train = "{root / 'tasks' / 'train'}"
generate_nano = false
[algo]
steps = {steps}
prompts_per_step = 1
group_size = 2
filter_zero_std = false
active_sampling = false
[run]
checkpoint_every = 1
concurrency = 2
rollout_workers = 1
slots_per_worker = 2
[guard]
enabled = false
""" + (_cluster(learner_ranks) if learner_ranks > 1 else "") + (f"[lora]\nrank = {lora_rank}\n" if lora_rank else "")
                   + (BRANCHING if branching else ""))
    return cfg


def _cluster(learner_ranks: int) -> str:
    # One CPU node that holds the learner ranks and the engine (`training.cluster.placement`).
    return f"""[cluster]
nodes = 1
gpus_per_node = 0
learners_per_node = {learner_ranks}
engines_per_node = 1
"""


def _leftovers(chaos: Chaos, wait_s: float = 90.0) -> tuple[list[str], list[str]]:
    """The run's containers and processes still there once every driver ended: a killed
    driver's processes end on their own watchdogs, so they get up to `wait_s` to go."""
    deadline = time.monotonic() + wait_s
    while True:
        procs = sorted({f"{p.pid} {' '.join(p.cmdline())[:80]}" for needle in RUN_PROCESSES
                        for p in chaos.processes(needle) if p.is_running()})
        containers = chaos.containers()
        if not (procs or containers) or time.monotonic() > deadline:
            return containers, procs
        time.sleep(2.0)


def _checks(chaos: Chaos, steps: int) -> dict:
    from tmax.training.learner import checkpoint as ckpt

    rollouts = _rollouts(chaos.run)
    keys = [(r["group_id"], r["sample_index"], tuple(r.get("branch_path") or ())) for r in rollouts]
    final = ckpt.latest_checkpoint(chaos.run)
    containers, procs = _leftovers(chaos)
    return {
        "steps_completed": int(ckpt.load_trainer_state(final)["step"]) if final else 0,
        "steps_target": steps,
        "steps_lost": chaos.steps_lost,
        # A scored episode that ran commands in a container and ended after its kill.
        "infra_rewards_in_loss": sum(1 for r in rollouts if any(_ran_after(r, c, t)
                                                                for c, t in chaos.killed_containers.items())),
        "duplicate_groups_in_loss": len(keys) - len(set(keys)),
        "leftover_containers": len(containers),
        "leftover_processes": len(procs),
        "leftovers": containers + procs,
        "drivers": [d.returncode for d in chaos.drivers],
    }


def _run(chaos: Chaos, in_driver: list[Fault], tail: list[str], rng: random.Random, steps: int) -> list[Fault]:
    """The first driver with the faults it must survive, then the driver-killing ones (each
    followed by a resumed driver); the last driver is waited for. Every driver left is
    interrupted on the way out."""
    driver = chaos.start_driver(resume=False)
    faults = list(in_driver)
    try:
        _in_driver_faults(chaos, driver, in_driver, rng)
        for kind in tail:
            faults.append(_driver_killing_fault(chaos, chaos.drivers[-1], kind, rng, steps))
        chaos.wait_rows(steps, chaos.drivers[-1])
        chaos.drivers[-1].wait(timeout=600)
    finally:
        for d in chaos.drivers:
            if d.poll() is None:
                d.send_signal(signal.SIGINT)
                try:
                    d.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    d.kill()
    return faults


def _adapter_figures(chaos: Chaos) -> dict:
    """A LoRA run: the bytes each step synced, and how often a restarted engine loaded the
    last adapter pushed (`EngineWeights.reload_last_push`, said in the drivers' log)."""
    text = chaos.log.read_text(errors="replace") if chaos.log.is_file() else ""
    return {"sync_bytes_per_step": sorted({r.get("weights/sync_bytes") for r in chaos.rows()} - {None}),
            "adapter_reloads": text.count("engine restarted: reloaded the last adapter pushed")}


def _by_kind(faults: list[Fault]) -> dict[str, dict]:
    by_kind: dict[str, dict] = {}
    for f in faults:
        k = by_kind.setdefault(f.kind, {"injected": 0, "detected": 0, "recovered": 0, "seconds_to_recover": [],
                                        "episodes_requeued": 0, "episodes_in_target": 0})
        k["injected"] += f.injected
        k["detected"] += f.detected
        k["recovered"] += f.recovered
        k["episodes_requeued"] += f.episodes_requeued
        k["episodes_in_target"] += f.episodes_in_target
        if f.seconds_to_recover is not None:
            k["seconds_to_recover"].append(f.seconds_to_recover)
    return by_kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="nano-podman", choices=["nano-podman", "nano"])
    ap.add_argument("--steps", type=int, default=0, help="steps of the run (default: enough for every fault)")
    ap.add_argument("--container-kills", type=int, default=3)
    ap.add_argument("--short", action="store_true", help="one container, the engine, a worker, the driver")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None, help="start from this nano checkpoint (default: a short SFT)")
    ap.add_argument("--learner-ranks", type=int, default=1, help="learner ranks on this machine (one is killed)")
    ap.add_argument("--step-timeout", type=float, default=1800.0, help="the longest wait for one step, in seconds")
    ap.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (lora.rank)")
    ap.add_argument("--branching", action="store_true", help="fork every episode after its first turn into two")
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    podman = args.preset == "nano-podman"
    kills = (1 if args.short else args.container_kills) if podman else 0
    in_driver = [Fault("container") for _ in range(kills)] + [Fault("engine"), Fault("worker")]
    rng.shuffle(in_driver)
    tail = ["driver"] if args.short else ["learner", "driver"]
    # A step per fault to recover in, and room for steps that finish while a fault is injected.
    steps = args.steps or len(in_driver) + len(tail) + 4
    root = args.out or Path(tempfile.mkdtemp(prefix="tmax-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = _setup(root, args.preset, steps, args.model, args.learner_ranks, args.lora_rank, args.branching)
    chaos = Chaos(root / "run", cfg, uuid.uuid4().hex[:12], root / "drivers.log", args.step_timeout)
    t0 = time.monotonic()
    faults = _run(chaos, in_driver, tail, rng, steps)
    out = {"preset": args.preset, "seed": args.seed, "learner_ranks": args.learner_ranks, "lora_rank": args.lora_rank,
           "branching": args.branching,
           "run_dir": str(chaos.run), **(_adapter_figures(chaos) if args.lora_rank else {}),
           "wall_s": round(time.monotonic() - t0, 1),
           "faults_injected": sum(f.injected for f in faults), "faults_recovered": sum(f.recovered for f in faults),
           "faults": _by_kind(faults), "schedule": [asdict(f) for f in faults], **_checks(chaos, steps)}
    record_result(args, out)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for kind, k in out["faults"].items():
            print(f"{kind:10s} injected {k['injected']} detected {k['detected']} recovered {k['recovered']} "
                  f"requeued {k['episodes_requeued']} recover_s {k['seconds_to_recover']}")
        print({k: v for k, v in out.items() if k not in ("faults", "schedule")})
    ok = (out["faults_injected"] == out["faults_recovered"] == len(faults) and out["infra_rewards_in_loss"] == 0
          and out["duplicate_groups_in_loss"] == 0 and out["steps_completed"] == steps
          and out["leftover_containers"] == out["leftover_processes"] == 0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
