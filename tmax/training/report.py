"""What a run reports: per-step metrics (one JSON line per step, always; wandb /
tensorboard when asked for), the step clock behind its time figures, the console progress
bar, the reward curve and the summary.

The JSONL file is the record of a run: each line is written with a single write and
flushed, so a crash loses at most the line being written, and `read_metrics` skips a
truncated last line; `common.files.trim_jsonl` drops it (and a killed run's steps past its checkpoint)
before a resumed run appends, so a cut line never swallows the next record.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from pydantic import BaseModel

from tmax.common.records import (GuardEvent, GuardEventKind, GuardSummary, LearnRunDir, RunSummary, metric,
                                 metric_values)

# The few metrics worth a console line, in display order, with short labels.
CONSOLE_KEYS = (
    ("val/avg_group_performance_post_filter", "reward"),
    ("val/avg_group_performance_pre_filter", "reward_pre"),
    ("loss/policy_avg", "loss"),
    ("debug/dppo_mask_frac_kept", "kept"),
    ("debug/vllm_vs_local_logprob_diff_max", "lp_diff_max"),
    ("optim/grad_norm", "grad"),
    ("batch/filtered_prompts", "filtered"),
    ("agentic/turns", "turns"),
    ("stale_results_dropped", "stale"),
    ("time/training", "t_train"),
)


def _clean(value: Any) -> Any:
    """JSON has no NaN / inf: write them as strings rather than produce invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):  # 0-d tensors / numpy scalars
        return _clean(value.item())
    return value


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb: bool = False,
        tensorboard: bool = False,
        project: str = "tmax",
        run_name: str | None = None,
        config: dict | None = None,
        filename: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename if filename else LearnRunDir(self.run_dir).metrics
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb = None
        self._tb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError as e:
                raise RuntimeError("wandb logging was asked for but wandb is not installed (pip install wandb)") from e
            self._wandb = wandb_lib.init(project=project, name=run_name, config=config or {}, dir=str(self.run_dir))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(
                    "tensorboard logging was asked for but tensorboard is not installed (pip install tensorboard)"
                ) from e
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics JSONL file."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return records


def summary(metrics: dict[str, Any]) -> dict[str, str]:
    """Short label -> formatted value for the console, for the keys present."""
    out = {}
    for key, label in CONSOLE_KEYS:
        if key in metrics:
            v = metrics[key]
            out[label] = f"{v:.4g}" if isinstance(v, float) else str(v)
    return out


class StepFigures(BaseModel):
    """What people see of a finished step: the console's key figures of its metrics."""

    step: int  # the run's position after the step (a rollback moves it back)
    reward: float | None  # mean reward of every episode finished during the step
    episodes: int  # episodes finished since the run (this process) started
    figures: dict[str, str]  # short label -> text (`summary`)

    @classmethod
    def of(cls, step: int, metrics: dict[str, Any]) -> StepFigures:
        return cls(step=step, reward=metric(metrics, "train/reward_all_rollouts"),
                   episodes=int(metric(metrics, "episode") or 0), figures=summary(metrics))


class LearnProgress(Protocol):
    """What a run tells the display that follows it (the CLI draws it: `tmax.cli.progress`);
    training itself draws nothing."""

    def environments(self, done: int, total: int) -> None:
        """`done` of `total` task environments resolved, before the first step."""

    def begin(self, total: int, done: int) -> None:
        """Training of `total` steps starts, `done` of them already run (a resume)."""

    def update(self, step: StepFigures) -> None:
        """A step finished."""

    def heldout(self, name: str, pass_rate: float) -> None:
        """A held-out pass rate (the recipe's eval of the starting checkpoint) shown beside the steps."""

    def note(self, text: str) -> None:
        """A line for people, between the updates."""

    def close(self) -> None: ...


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """`42s`, `3m 05s`, `1h 02m`: an ETA or a stage's time for a log line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class StepLines:
    """The display of a run whose output is a log (stderr not a terminal, `--no-progress`,
    `--json`, a cluster job): one line per step with its reward, the held-out figures
    there are, the episodes so far, the seconds a step and the ETA; notes (guard events,
    interrupts) as lines of their own."""

    def __init__(self, log: Callable[[str], None] = _stderr_line) -> None:
        self.log = log
        self.total = self.updates = 0
        self.started = time.monotonic()
        self.heldouts: dict[str, float] = {}

    def environments(self, done: int, total: int) -> None: ...

    def begin(self, total: int, done: int) -> None:
        self.total, self.updates, self.started = total, 0, time.monotonic()

    def update(self, step: StepFigures) -> None:
        self.updates += 1
        self.log(self.line(step, time.monotonic() - self.started, self.updates))

    def line(self, step: StepFigures, elapsed_s: float, updates: int) -> str:
        """`step 3/20: reward 0.45, held-out SFT 39.1%, 210 episodes, 9.8 s/step, ETA 2m 45s`:
        the pace over the `updates` steps this process trained (a resume's earlier steps and a
        rollback's position jumps do not count)."""
        per_step = elapsed_s / max(1, updates)
        parts = [f"reward {step.reward:.3f}" if step.reward is not None else "reward -"]
        parts += [f"held-out {name} {rate:.1%}" for name, rate in self.heldouts.items()]
        parts += [f"{step.episodes} episodes", f"{per_step:.1f} s/step",
                  f"ETA {duration(per_step * max(0, self.total - step.step))}"]
        return f"step {step.step}/{self.total}: " + ", ".join(parts)

    def heldout(self, name: str, pass_rate: float) -> None:
        self.heldouts[name] = pass_rate

    def note(self, text: str) -> None:
        self.log(text)  # notes (guard events, interrupts) are never dropped

    def close(self) -> None: ...


def reward_curve(metrics_path: Path, out_png: Path) -> str | None:
    """Training reward per logged step. The x axis is the order of the rows, so the steps a
    collapse-guard rollback discarded stay visible (faded), and each rollback is a red
    dashed line labelled with the step the run went back to."""
    if not metrics_path.exists():
        return None
    logged = read_metrics(metrics_path)
    rows = [r for r in logged if "guard/stall" not in r]  # a judged stall is not a step
    if not rows:
        return None
    from tmax.tasks.charts import pyplot

    plt = pyplot()

    xs = list(range(1, len(rows) + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("train/reward_all_rollouts", "all rollouts"),
                       ("val/avg_group_performance_pre_filter", "groups, pre-filter"),
                       ("val/avg_group_performance_post_filter", "groups, post-filter")):
        ys = [metric(r, key) for r in rows]
        if any(y is not None for y in ys):
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker=".", label=label)
    events = _event_positions(logged)
    for n, (x, ev) in enumerate((x, e) for x, e in events if e.kind == GuardEventKind.ROLLBACK):
        ax.axvline(x + 0.5, color="red", linestyle="--", alpha=0.8, label="guard rollback" if n == 0 else None)
        ax.text(x + 0.6, 0.97, f"back to step {ev.to_step}", color="red", fontsize=7, va="top", rotation=90)
        ax.axvspan(x - ev.steps_lost + 0.5, x + 0.5, color="red", alpha=0.06)
    ax.set_xlabel("logged step (rolled-back steps included)" if events else "training step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("tmax learn: training reward")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return str(out_png)


def _event_positions(logged: list[dict]) -> list[tuple[int, GuardEvent]]:
    """(x, event) of each guard event: x = the steps plotted up to its row (a stall's row
    is not plotted: its event sits after the last step before it)."""
    out, x = [], 0
    for r in logged:
        x += "guard/stall" not in r
        if "guard/event" in r:
            out.append((x, GuardEvent.model_validate(r["guard/event"])))
    return out


def guard_events(rows: list[dict]) -> list[GuardEvent]:
    """The collapse guard's events (rollbacks, a stop) recorded in metrics rows, in order."""
    return [GuardEvent.model_validate(r["guard/event"]) for r in rows if "guard/event" in r]


def guard_summary(rows: list[dict]) -> GuardSummary:
    events = guard_events(rows)
    rollbacks = [e for e in events if e.kind == GuardEventKind.ROLLBACK]
    stop = next((e for e in events if e.kind == GuardEventKind.STOP), None)
    return GuardSummary(rollbacks=len(rollbacks), steps_lost=sum(e.steps_lost for e in rollbacks),
                        stopped=stop is not None, stop_reason=stop.reason if stop else None, events=events)


def guard_report(g: GuardSummary) -> list[str]:
    """Console lines for the guard section of a run summary (`tmax learn report`)."""
    if not g.events:
        return ["collapse guard: no rollback"]
    lines = [f"collapse guard: {g.rollbacks} rollback(s), {g.steps_lost} step(s) lost"
             + (f"; stopped: {g.stop_reason}" if g.stopped else "")]
    for e in g.events:
        lines.append(f"  {describe_event(e)}")
        lines += [f"      {a.signal} {a.value} (baseline {a.baseline}, limit +-{a.threshold})" for a in e.alarms]
    return lines


def describe_event(e: GuardEvent) -> str:
    if e.kind == GuardEventKind.ROLLBACK:
        return (f"step {e.step}: collapse ({', '.join(a.signal for a in e.alarms)}) -> back to step "
                f"{e.to_step}, {e.remedy}" + (f" (LR x{e.lr_scale:g})" if e.remedy == "lower_lr" else "")
                + (f" (group size {e.group_size})" if e.remedy == "raise_group_size" else ""))
    return f"step {e.step}: stopped: {e.reason}"


def run_summary(metrics_path: Path, setup_s: float, run_s: float) -> RunSummary:
    logged = read_metrics(metrics_path) if metrics_path.exists() else []
    rows = [r for r in logged if "guard/stall" not in r]  # judged stalls are not steps

    def avg(key: str, part: list[dict]) -> float | None:
        vals = metric_values(part, key)
        return round(sum(vals) / len(vals), 4) if vals else None

    k = max(1, len(rows) // 4)
    first, last = rows[:k], rows[-k:]
    return RunSummary(
        steps=int(rows[-1]["step"]) if rows else 0,
        updates=len(rows),
        setup_s=round(setup_s, 1),
        run_s=round(run_s, 1),
        reward_first_quarter=avg("train/reward_all_rollouts", first),
        reward_last_quarter=avg("train/reward_all_rollouts", last),
        post_filter_reward_first_quarter=avg("val/avg_group_performance_post_filter", first),
        post_filter_reward_last_quarter=avg("val/avg_group_performance_post_filter", last),
        mask_frac_kept_mean=avg("debug/dppo_mask_frac_kept", rows),
        logprob_diff_max_mean=avg("debug/vllm_vs_local_logprob_diff_max", rows),
        train_step_s_mean=avg("time/training", rows),
        weight_sync_s_mean=avg("time/weight_sync", rows),
        episodes=int(metric(rows[-1], "episode") or 0) if rows else 0,
        # The agentic side (`training.agentic`): turns per episode, per solved one, ended on the step budget.
        turns_first_quarter=avg("agentic/turns", first),
        turns_last_quarter=avg("agentic/turns", last),
        turns_solved_last_quarter=avg("agentic/turns_solved", last),
        max_steps_rate_last_quarter=avg("agentic/max_steps_rate", last),
        guard=guard_summary(logged),
    )


ENV_METRIC = "env/tmax_bash/step_count"


def rollout_metrics(rollouts: list) -> dict[str, float]:
    """Means over `rollouts` (`training.rollout.Rollout`): lengths, endings, rewards, times."""
    n = max(1, len(rollouts))
    lengths = [len(r.ids) for r in rollouts] or [0]
    return {
        ENV_METRIC: sum(r.steps for r in rollouts) / n,
        "tools/bash/avg_calls_per_rollout": sum(sum(1 for _ in r.turn_versions) for r in rollouts) / n,
        "val/sequence_lengths": sum(lengths) / n,
        "val/sequence_lengths_min": float(min(lengths)),
        "val/sequence_lengths_max": float(max(lengths)),
        "val/stop_rate": sum(1 for r in rollouts if not r.truncated) / n,
        "val/truncated_completion_fraction": sum(1 for r in rollouts if r.truncated) / n,
        "val/non_submitting_completion_fraction": sum(1 for r in rollouts if not r.submitted) / n,
        "objective/verifiable_reward": sum(r.reward for r in rollouts) / n,
        "objective/verifiable_correct_rate": sum(1 for r in rollouts if r.reward >= 1.0) / n,
        "time/episode_mean_s": sum(r.timings.get("total_s", 0.0) for r in rollouts) / n,
        "time/sandbox_start_mean_s": sum(r.timings.get("sandbox_start_s", 0.0) for r in rollouts) / n,
        "env/warm_start_frac": sum(1 for r in rollouts if r.warm_start) / n,
    }


def throughput_metrics(since: list, step_wall: float) -> dict[str, float]:
    """The tokens sampled and environment steps taken by the episodes finished during a
    step (`since`, `training.rollout.Rollout`s), in all and per second of its wall."""
    sampled = sum(x.num_sampled for x in since)
    return {"perf/sampled_tokens": float(sampled), "perf/sampled_tokens_per_s": sampled / step_wall,
            "perf/env_steps_per_s": sum(x.steps for x in since) / step_wall}


def health_metrics(rollouts: list, requeued: int = 0) -> dict[str, float]:
    """The collapse guard's rollout-side signals (`health/*`) over every episode finished
    since the last step (filtered groups included), and the infra-error rate among the
    episodes attempted (finished + re-queued after an infrastructure failure)."""
    infra = {"health/episodes": float(len(rollouts)),
             "health/infra_error_rate": requeued / max(1, len(rollouts) + requeued)}
    if not rollouts:  # no episode finished during the step: nothing to measure (not zeros)
        return infra
    n = len(rollouts)
    sampled = [lp for r in rollouts for lp, m in zip(r.trace.logprobs, r.trace.mask) if m]
    groups: dict[int, list] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(tuple(t for t, m in zip(r.ids, r.trace.mask) if m))
    # Per group of k >= 2 finished samples: (k - distinct responses) / (k - 1), 0 when all
    # differ, 1 when all are the same.
    shares = [(len(g) - len(set(g))) / (len(g) - 1) for g in groups.values() if len(g) > 1]
    return {
        **infra,
        "health/reward": sum(r.reward for r in rollouts) / n,
        "health/format_error_rate": sum(1 for r in rollouts if r.status == "format_errors") / n,
        "health/submit_rate": sum(1 for r in rollouts if r.submitted) / n,
        "health/turns": sum(r.steps for r in rollouts) / n,
        "health/response_tokens": sum(r.num_sampled for r in rollouts) / n,
        # Mean -log p of the sampled tokens: a Monte-Carlo estimate of the policy's entropy.
        "health/sampled_entropy": -sum(sampled) / max(1, len(sampled)),
        "health/identical_sample_frac": sum(shares) / len(shares) if shares else 0.0,
    }


@dataclass
class StepClock:
    """Wall-time bookkeeping of the step being gathered and trained."""

    run_start: float
    wait_started: float  # end of the previous step: from here the loop waits for a batch
    last_tick: float
    step_wall_start: float
    wait_s: float = 0.0
    train_started: float = 0.0
    busy_s: float = 0.0  # time with at least one episode in flight (sampler busy)

    @classmethod
    def now(cls) -> "StepClock":
        t = time.monotonic()
        return cls(run_start=t, wait_started=t, last_tick=t, step_wall_start=t)

    def tick(self, sampling: bool, now: float) -> None:
        """Credit the time since the last tick to the sampler when episodes were in flight.
        (An approximation: it counts the interval as busy when episodes are pending at its end.)"""
        if sampling:
            self.busy_s += now - self.last_tick
        self.last_tick = now

    def new_step(self, now: float) -> None:
        """The next step's wall starts here; sampler time before it belongs to the last step."""
        self.busy_s, self.step_wall_start, self.last_tick = 0.0, now, now

    def sampler_busy_frac(self, now: float) -> float:
        """Share of the step's wall with at least one episode in flight. 0 is a real value: with
        async steps, a step's batch (and the next one's) can all be sampled during the step before."""
        return min(1.0, self.busy_s / max(1e-9, now - self.step_wall_start))
