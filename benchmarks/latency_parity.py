"""A command's round trip (issue -> output back) in training against evaluation.

Training: episodes run as `tmax learn` runs them, by the production rollout worker (a Ray
actor, its pool of episodes in shared containers, `EpisodeSettings` of the nano-podman
preset), each command's round trip recorded in its `Rollout.command_s`. Evaluation: a
`tmax bench` job (`tasks.job.Job`, the `tmax` agent, its trials' `timing.json`). Both on the
same nano task (the same image), on the same machine, while a real learner trains without
pause beside them (a process running `Learner.train_step` on the nano model), in
alternating rounds. Both sides issue the same commands: the policy is scripted (a token
sampler for the worker, an OpenAI-compatible endpoint for the bench agent), so what is
measured is the sandbox path, not a model.

    python benchmarks/latency_parity.py [--rounds 12] [--episodes 8] [--commands 6] [--think-ms 200]
        [--think-spread 0] [--json]

`--think-ms` is how long each policy takes to answer a turn, the same on both sides. A rollout
always waits for its model between two commands; with 0 the worker's episodes issue their
commands back to back, a burst neither training nor evaluation produces.

`--json` prints `train_p50_ms`, `eval_p50_ms`, `train_p99_ms`, `eval_p99_ms` (and the
counts); the goal is train p50 <= 1.2 x eval p50 and p99 <= 1.5 x.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import add_record_arguments, record_result  # noqa: E402


def commands(n: int) -> list[str]:
    from tmax.agents.prompts import SUBMIT_COMMAND

    return [f"echo round-trip-{i}" for i in range(n)] + [SUBMIT_COMMAND]


# ---- the busy learner -----------------------------------------------------------------


def learner_loop(model_dir: str) -> None:
    """Train the nano model without pause (the learner of a run in the middle of its steps)."""
    import random

    from tmax.agents.policy import TokenTrace
    from tmax.training.config import preset
    from tmax.training.learner.learner import Learner
    from tmax.training.learner.packing import TrainSample
    from tmax.training.trainer import learner_config

    learner = Learner(model_dir, learner_config(preset("nano")))
    rng = random.Random(0)
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    samples = []
    for i in range(16):
        ids = [rng.randrange(vocab) for _ in range(200)]
        trace = TokenTrace([rng.randrange(vocab) for _ in range(300)], ids, [-1.0] * len(ids), [1] * len(ids))
        samples.append(TrainSample(trace, advantage=1.0 if i % 2 else -1.0))
    while True:
        learner.train_step(samples)


# ---- the policy, both ways ------------------------------------------------------------


class Thinking:
    """How long a policy takes to answer a turn: `think_s` scaled by a draw from
    uniform(1 - spread, 1 + spread), the same distribution on both sides. A model's turns vary
    in length; with spread 0 every episode of a round issues its k-th command at the same
    instant, a lockstep of all eight that no sampled run keeps."""

    def __init__(self, think_s: float, spread: float, seed: int):
        self.think_s, self.spread, self.seed = think_s, spread, seed
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"think_s": self.think_s, "spread": self.spread, "seed": self.seed}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def wait(self) -> None:
        with self.lock:
            scale = self.rng.uniform(1 - self.spread, 1 + self.spread) if self.spread else 1.0
        time.sleep(self.think_s * scale)


class ScriptSampler:
    """A token sampler that answers turn k with the k-th scripted turn, whatever order the
    worker's episodes ask in. Every episode is the same (same prompt, same commands, same
    outputs), so the prompt of turn k has the same length in all of them and lengths grow with
    k: the k-th distinct length seen is turn k's. O(1), as a real sampler's share of the
    worker's CPU is (a request to the engine), not a search through the prompt."""

    def __init__(self, turns: list[list[int]], thinking: Thinking):
        self.turns = turns
        self.thinking = thinking
        self.lengths: dict[int, int] = {}
        self.lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"turns": self.turns, "thinking": self.thinking}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["turns"], state["thinking"])

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None):
        from tmax.agents.policy import SampledTokens

        self.thinking.wait()
        with self.lock:
            k = min(self.lengths.setdefault(len(prompt_ids), len(self.lengths)), len(self.turns) - 1)
        return SampledTokens(self.turns[k], [0.0] * len(self.turns[k]), "stop", 0)


def chat_server(script: list[str], thinking: Thinking) -> ThreadingHTTPServer:
    """An OpenAI-compatible endpoint answering each chat request, a `thinking` wait after it came,
    with the next command of `script` as a `bash` tool call (the k-th once k tool results are
    in the request)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send({"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": 32768}]})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            thinking.wait()
            k = min(sum(1 for m in req["messages"] if m.get("role") == "tool"), len(script) - 1)
            call = {"id": f"call_{k}", "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": script[k]})}}
            self._send({"id": f"c{k}", "object": "chat.completion", "created": 0, "model": "scripted",
                        "choices": [{"index": 0, "finish_reason": "tool_calls",
                                     "message": {"role": "assistant", "content": "", "tool_calls": [call]}}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# ---- the two sides ----------------------------------------------------------------------


def train_round(worker, task: str, n: int, group: int) -> list[float]:
    """n episodes at once through the rollout worker; every command's round trip (s)."""
    import ray

    from tmax.training.rollout import EpisodeRequest

    out: list[float] = []
    for res in ray.get([worker.generate.remote(EpisodeRequest(task, group, i, i), 0) for i in range(n)]):
        if res.rollout is None:
            raise RuntimeError(f"a training episode failed: {res}")
        out += res.rollout.command_s
    return out


def eval_round(dataset: Path, task: str, url: str, n: int, jobs_dir: Path, kwargs: dict, name: str) -> list[float]:
    """A `tmax bench` job of n trials of the task at once; every command's round trip (s)."""
    from tmax.tasks.job import Job, JobSpec

    Job(JobSpec(job_name=name, jobs_dir=str(jobs_dir), dataset=str(dataset), include=[Path(task).name],
                  agent="tmax", model="scripted", base_url=url, agent_kwargs=kwargs, n_attempts=n,
                  n_concurrent=n), api_key="none").run()
    out: list[float] = []
    for timing in sorted((jobs_dir / name).glob("*/agent/timing.json")):
        out += [s["bash_s"] for s in json.loads(timing.read_text()) if "bash_s" in s]
    return out


def percentiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=100, method="inclusive")
    return round(statistics.median(xs) * 1000, 2), round(q[98] * 1000, 2)


def ratio_intervals(train: list[list[float]], evals: list[list[float]], draws: int = 2000,
                    seed: int = 0) -> dict[str, list[float]]:
    """90 % intervals of the p50 and p99 ratios, resampling whole rounds (with replacement,
    each side apart): a round's commands share its load, so they are not independent draws,
    and the interval says how far another run of as many rounds could land."""
    rng = random.Random(seed)
    p50s, p99s = [], []
    for _ in range(draws):
        t = [x for _ in train for x in rng.choice(train)]
        e = [x for _ in evals for x in rng.choice(evals)]
        (t50, t99), (e50, e99) = percentiles(t), percentiles(e)
        p50s.append(t50 / e50)
        p99s.append(t99 / e99)
    def interval(xs: list[float]) -> list[float]:
        q = statistics.quantiles(xs, n=20, method="inclusive")
        return [round(q[0], 3), round(q[-1], 3)]
    return {"p50_ratio_90ci": interval(p50s), "p99_ratio_90ci": interval(p99s)}


def setup(root: Path, n_commands: int):
    """The nano model, its tokenizer, one nano task with its image, the episodes' settings."""
    from tmax.training.config import preset
    from tmax.training.nano.model import build_nano_model, build_tokenizer
    from tmax.training.nano.tasks import write_splits
    from tmax.training.rollout import EpisodeSettings, prepare_tasks, run_labels

    build_nano_model(root / "model", seed=0)
    build_tokenizer(0).save_pretrained(root / "tok")
    [task] = write_splits(root / "tasks", 1, 0, seed=0)["train"]
    rollout = preset("nano-podman").rollout.model_copy(update={
        "max_steps": n_commands + 1, "observation_max_chars": 2000, "max_tokens": 300,
        "response_budget": 6000, "context_budget": 8192, "max_prompt_tokens": 2048})
    settings = EpisodeSettings.of(rollout, run_labels(root / "run"))
    images = prepare_tasks(settings.env, [str(task)], log=lambda m: None).images
    return str(task), settings, images, rollout.agent_only().model_dump(mode="json", exclude_none=True)


def start_ray(connect, cluster, attempts: int = 4):
    """The private Ray `tmax learn` starts on one machine; its raylet gets 30 s to register,
    which a machine under heavy load can miss: tried again (an infrastructure failure)."""
    from tmax.training.cluster.launch import ClusterError

    for i in range(attempts):
        try:
            return connect(cluster)
        except ClusterError:
            if i == attempts - 1:
                raise
            time.sleep(15)


def measure(args, root: Path) -> dict:
    import ray
    from transformers import AutoTokenizer

    from tmax.common.proctree import parent_death_hook
    from tmax.training.cluster.rollout_worker import RolloutWorker
    from tmax.training.cluster.launch import connect
    from tmax.training.config import ClusterConfig
    from tmax.training.demos import scripted_turns

    task, settings, images, kwargs = setup(root, args.commands)
    srv = chat_server(commands(args.commands), Thinking(args.think_ms / 1000, args.think_spread, seed=1))
    turns = scripted_turns(AutoTokenizer.from_pretrained(root / "tok"),
                           [("THOUGHT: go.", c) for c in commands(args.commands)])
    # The learner ends with this script, even one killed by SIGKILL: a learner left behind
    # would load every later run on the machine.
    learner = subprocess.Popen([sys.executable, __file__, "--learner-loop", str(root / "model")],
                               preexec_fn=parent_death_hook(signal.SIGKILL))
    handle = worker = None
    train: list[list[float]] = []  # each recorded round's round trips (s)
    evals: list[list[float]] = []
    wall = {"train": 0.0, "eval": 0.0}  # seconds of each side's recorded rounds, summed
    try:
        handle = start_ray(connect, ClusterConfig(num_cpus=4))
        worker = ray.remote(RolloutWorker).options(num_cpus=0.5, max_concurrency=args.episodes + 2).remote(
            str(root / "tok"), settings, ScriptSampler(turns, Thinking(args.think_ms / 1000, args.think_spread, seed=2)), images, args.episodes)
        ray.get(worker.node_id.remote(), timeout=600)  # the worker past its start (tokenizer, pool)
        time.sleep(args.warmup)  # the learner past its start, training
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        # Unrecorded: each side's first episodes start its shared container.
        train_round(worker, task, args.episodes, args.rounds)
        eval_round(Path(task).parent, task, url, args.episodes, root / "jobs", kwargs, "eval-warm")
        for r in range(args.rounds):  # ABBA: load that drifts over the run falls on both sides alike
            sides = [("train", lambda: train.append(train_round(worker, task, args.episodes, r))),
                     ("eval", lambda: evals.append(eval_round(Path(task).parent, task, url, args.episodes,
                                                              root / "jobs", kwargs, f"eval-{r}")))]
            for name, side in sides if r % 2 == 0 else sides[::-1]:
                t0 = time.monotonic()
                side()
                wall[name] += time.monotonic() - t0
            if learner.poll() is not None:
                raise RuntimeError("the busy learner stopped")
    finally:
        if worker is not None:
            ray.get(worker.close.remote(), timeout=300)
            ray.kill(worker)
        if handle is not None:
            handle.shutdown()
        learner.kill()
        learner.wait()
        srv.shutdown()
    tp50, tp99 = percentiles([x for r in train for x in r])
    ep50, ep99 = percentiles([x for r in evals for x in r])
    n_train, n_eval = sum(map(len, train)), sum(map(len, evals))
    return {"train_p50_ms": tp50, "eval_p50_ms": ep50, "train_p99_ms": tp99, "eval_p99_ms": ep99,
            "p50_ratio": round(tp50 / ep50, 3), "p99_ratio": round(tp99 / ep99, 3),
            **ratio_intervals(train, evals), "train_commands": n_train, "eval_commands": n_eval,
            # How densely each side issues commands: with no think time the side with less
            # work between two commands has more of them in flight at once on the same cores.
            "train_commands_per_s": round(n_train / wall["train"], 2),
            "eval_commands_per_s": round(n_eval / wall["eval"], 2), "rounds": args.rounds,
            "episodes_per_round": args.episodes, "think_ms": args.think_ms, "think_spread": args.think_spread}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    add_record_arguments(ap, __file__)
    ap.add_argument("--rounds", type=int, default=12,
                    help="alternating rounds of training and evaluation (at 4, a side's p99 is its third slowest "
                         "of 224 commands)")
    ap.add_argument("--episodes", type=int, default=8, help="episodes (trials) at once per round and side")
    ap.add_argument("--commands", type=int, default=6, help="commands per episode before its submit")
    ap.add_argument("--think-ms", type=float, default=200.0,
                    help="how long both policies take to answer a turn (a model's turn: the nano recipe's RL "
                         "turns took 0.18-0.21 s at the median on a 2-core machine); 0 answers at once")
    ap.add_argument("--think-spread", type=float, default=0.0,
                    help="each turn waits think-ms x uniform(1 - spread, 1 + spread); 0: every turn the same")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds the learner trains before measuring")
    ap.add_argument("--learner-loop", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.learner_loop:
        learner_loop(args.learner_loop)
        return
    with tempfile.TemporaryDirectory(prefix="tmax-latency-") as tmp:
        out = measure(args, Path(tmp))
    record_result(args, out)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
