"""Collapse detection over a run's own per-step metrics (pure: no Ray, no torch, no I/O).

A `Detector` is fed one metrics row per training step (the dict `tmax learn` writes to
metrics.jsonl) and returns a `Verdict`. The rule:

1. **Per signal, a robust change test.** For each signal in `SIGNALS` present in the row,
   the baseline is the median m of its last `window` values from steps judged healthy and
   the spread is s = 1.4826 * MAD of those values (a robust standard deviation). The signal
   alarms when it moves in its bad direction by more than
   max(`mad_k` * s, floor + rel_floor * |m|): the floor is the smallest change that means
   something for that signal (one step's batch mean reward moves by about +-0.15 from
   sampling alone), so a short or very steady history never alarms on noise. A non-finite
   loss or gradient norm alarms at once.
2. **Combination.** A step meets the rule when at least one *outcome* signal (training
   reward, format-error rate, submit rate) alarms and at least `min_policy_alarms`
   *policy* signals (entropy of the sampled tokens, share of identical samples in a group,
   mean turns, response length, DPPO mask kept fraction, train/inference logprob
   difference, gradient norm) alarm at that step or at an earlier step of the same unbroken
   run of alarm steps; `patience` (two) such steps in a row are a collapse. Either kind
   alone is not enough: a policy that sharpens as it learns (lower entropy, more identical
   samples) has rising reward, and a reward dip without a change in the policy is noise.
   The policy change may come first: in a recorded late collapse of the nano-podman recipe
   (steps 12-19 all alarmed) the logprob differences and gradient norm alarmed at steps
   13-16 and the reward fell to 0.07 and 0.06 at steps 18-19 with no policy alarm of its
   own, so a rule that needed both at one step never called it.
   One step is not enough either: on the nano recipe's healthy runs a single step dips as
   far as a collapse starts (format errors 0.1 -> 0.35-0.8, submits down, grad norm or
   logprob difference up) and the next step is back in range, while a collapse is still
   there at the next step, or deeper (docs/results/notebook.md, "Collapse guard"). A step that
   meets the rule is an "alarm" and stays out of the baseline; the second in a row is the
   collapse. A non-finite update needs no second step, nor does a stall (the episodes
   gathered while `stall_groups` groups in a row had no reward variance: a persistence of
   its own).
3. **Enough episodes.** The rollout-side signals (`health/*`) are rates over the episodes
   finished since the last step; with fewer than `min_episodes` of them only the learner's
   signals are judged.
4. **Infrastructure veto.** A step whose infra-error rate (episodes re-queued for
   infrastructure failures over episodes attempted) is above `max_infra_rate` is not
   judged ("infra"): trouble with sandboxes or the inference server never reads as a
   policy collapse, and such a step does not enter the baseline either.

The first `min_history` steps (one by default) only build the baseline ("warming"); from
then on a signal is judged once it has its own `Signal.min_history` healthy values. With a
short history the floors, not the spread, set the limit: a collapse that starts at the
second step is caught there instead of widening the spread it is measured against. The
train/inference logprob differences wait for two steps, because the first step trains on
samples of the very weights it starts from, so its difference is exactly 0 and any later
step would look like a jump from it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from tmax.common.records import GuardEvent, GuardEventKind, metric

Direction = Literal["up", "down", "both"]
Role = Literal["outcome", "policy"]
Status = Literal["warming", "healthy", "alarm", "collapse", "infra"]

INFRA_RATE = "health/infra_error_rate"
EPISODES = "health/episodes"
STALL, EVENT = "guard/stall", "guard/event"  # what `training.rollback` adds to a metrics row


@dataclass(frozen=True)
class Signal:
    """One health signal: the metrics key it is read from and which change is bad."""

    name: str
    key: str
    bad: Direction
    role: Role
    floor: float  # smallest absolute change that counts
    rel_floor: float = 0.0  # plus this share of the baseline's magnitude
    # Healthy steps the baseline needs before this signal is judged. Two for the
    # train/inference logprob difference: the first step trains on samples of the very
    # weights it starts from, so its difference is exactly 0 and says nothing of the next.
    min_history: int = 1


SIGNALS: tuple[Signal, ...] = (
    Signal("reward", "health/reward", "down", "outcome", 0.2),
    Signal("format_errors", "health/format_error_rate", "up", "outcome", 0.2),
    Signal("submit_rate", "health/submit_rate", "down", "outcome", 0.2),
    Signal("entropy", "health/sampled_entropy", "both", "policy", 0.05, 0.5),
    # Both ways: a policy collapses onto one command (up) or into varied garbage (down).
    Signal("identical", "health/identical_sample_frac", "both", "policy", 0.25),
    Signal("turns", "health/turns", "both", "policy", 0.5, 0.25),
    Signal("length", "health/response_tokens", "both", "policy", 0.0, 0.35),
    Signal("mask_kept", "debug/dppo_mask_frac_kept", "down", "policy", 0.05),
    Signal("logprob_diff_max", "debug/vllm_vs_local_logprob_diff_max", "up", "policy", 0.5, 1.0, min_history=2),
    Signal("logprob_diff_mean", "debug/vllm_vs_local_logprob_diff_mean", "up", "policy", 0.02, 1.0, min_history=2),
    Signal("grad_norm", "optim/grad_norm", "up", "policy", 0.0, 2.0),
)
# Keys whose non-finite value is an alarm by itself (the update already blew up).
FINITE_KEYS = ("loss/policy_avg", "optim/grad_norm")


@dataclass(frozen=True)
class DetectorConfig:
    """The rule's knobs (`GuardConfig` carries them in a run config)."""

    window: int = 8
    min_history: int = 1
    mad_k: float = 4.0
    min_policy_alarms: int = 1
    patience: int = 2
    max_infra_rate: float = 0.25
    min_episodes: int = 8


class GuardConfig(BaseModel):
    """The collapse guard (`training.guard` detects, `training.rollback` acts): on a
    detected collapse the step is dropped, the run goes back to its last checkpoint marked
    healthy, `remedy` is applied and training continues; after `max_rollbacks` it stops.
    The `[guard]` section of a run config (`training.config.LearnConfig`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: Annotated[bool, Field(description="Watch the run for a collapse and roll back when one is "
                                               "detected.")] = False
    # The detector's rule (see training/guard.py): rolling median / MAD over `window`
    # healthy steps, alarm beyond max(mad_k * 1.4826 * MAD, the signal's floor).
    window: Annotated[int, Field(ge=1, description="Healthy steps the detector's median and spread are taken "
                                                   "over.")] = 8
    min_history: Annotated[int, Field(ge=1, description="Healthy steps seen before the detector judges any.")] = 1
    mad_k: Annotated[float, Field(gt=0, description="How many (scaled) median absolute deviations from the median "
                                                    "raise an alarm; larger: fewer alarms.")] = 4.0
    min_policy_alarms: Annotated[int, Field(ge=1, description="Policy signals (entropy, identical samples, ...) "
                                                              "that must alarm beside an outcome signal (reward, ...) "
                                                              "before a step meets the rule.")] = 1
    # A stall or a non-finite update is a collapse at once. Two: a healthy run's one-step
    # dips recover at the next step.
    patience: Annotated[int, Field(ge=1, description="Steps in a row that meet the rule before it is a "
                                                     "collapse.")] = 2
    max_infra_rate: Annotated[float, Field(ge=0, le=1, description="Share of episodes failing for the "
                                                                   "infrastructure above which a step is in alarm.")] = 0.25
    min_episodes: Annotated[int, Field(ge=1, description="Episodes finished since the last step below which the "
                                                         "rollout signals are not judged.")] = 8
    # A collapsed policy fails every episode, so no batch ever fills.
    stall_groups: Annotated[int, Field(ge=1, description="Zero-variance groups in a row after which the episodes "
                                                         "sampled since the last step are judged.")] = 16
    # By `async_steps` + 1 every episode sampled from it has been judged.
    confirm_steps: Annotated[int | None, Field(ge=1, description="Steps without an alarm after a checkpoint "
                                                                 "before it counts as healthy (unset: async_steps + 1).")] = None
    remedy: Annotated[Literal["lower_lr", "raise_group_size", "skip_batch"], Field(
        description="What changes after a rollback: lower the learning rate, raise the group size, or only skip "
                    "the batch.")] = "lower_lr"
    lr_factor: Annotated[float, Field(gt=0, lt=1, description="lower_lr: the learning rate is multiplied by this "
                                                              "per rollback.")] = 0.5
    group_factor: Annotated[int, Field(ge=2, description="raise_group_size: the group size is multiplied by this "
                                                         "per rollback.")] = 2
    max_rollbacks: Annotated[int, Field(ge=1, description="Rollbacks after which the run stops.")] = 3

    def detector(self) -> DetectorConfig:
        return DetectorConfig(window=self.window, min_history=self.min_history, mad_k=self.mad_k,
                              min_policy_alarms=self.min_policy_alarms, patience=self.patience,
                              max_infra_rate=self.max_infra_rate, min_episodes=self.min_episodes)


@dataclass(frozen=True)
class Alarm:
    signal: str
    value: float
    baseline: float
    threshold: float  # the change that was needed
    role: Role

    def as_dict(self) -> dict[str, Any]:
        return {"signal": self.signal, "value": _round(self.value), "baseline": _round(self.baseline),
                "threshold": _round(self.threshold), "role": self.role}

    def describe(self) -> str:
        return f"{self.signal} {_round(self.value)} (baseline {_round(self.baseline)}, limit +-{_round(self.threshold)})"


@dataclass(frozen=True)
class Verdict:
    step: int
    status: Status
    alarms: tuple[Alarm, ...] = ()
    infra_rate: float = 0.0

    @property
    def collapse(self) -> bool:
        return self.status == "collapse"

    def describe(self) -> str:
        if self.status == "infra":
            return f"step {self.step}: infra-error rate {self.infra_rate:.0%}, not judged"
        return f"step {self.step}: {self.status}" + (": " + "; ".join(a.describe() for a in self.alarms)
                                                      if self.alarms else "")


@dataclass
class Detector:
    cfg: DetectorConfig = field(default_factory=DetectorConfig)
    signals: tuple[Signal, ...] = SIGNALS
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (step, values) of healthy steps
    streak: int = 0  # judged steps in a row that met the collapse rule
    policy_in_run: bool = False  # a policy change in the current unbroken run of alarm steps

    def judge(self, step: int, row: Mapping[str, Any], stall: bool = False) -> Verdict:
        """The verdict on `step`'s metrics `row`; healthy steps join the baseline. A `stall`
        row (the episodes gathered while no batch filled) is not a training step: it never
        joins the baseline, and meeting the rule there needs no confirmation, since the
        groups in a row without reward variance that led to it already are persistence."""
        infra = metric(row, INFRA_RATE) or 0.0
        if infra > self.cfg.max_infra_rate:
            return Verdict(step, "infra", infra_rate=infra)
        values = {s.name: v for s in self.signals if (v := metric(row, s.key)) is not None}
        if (metric(row, EPISODES) or 0.0) < self.cfg.min_episodes:
            # Rates over a handful of episodes are noise: judge the learner's signals only.
            values = {k: v for k, v in values.items() if not self._rollout_side(k)}
        if len(self.history) < self.cfg.min_history:
            if not stall:
                self._remember(step, values)
            return Verdict(step, "warming", infra_rate=infra)
        alarms = tuple(a for s in self.signals if (a := self._test(s, values.get(s.name))) is not None)
        alarms += tuple(Alarm(k, float(row[k]), 0.0, 0.0, "policy") for k in FINITE_KEYS
                        if k in row and not _is_finite(row[k]))
        outcome = sum(1 for a in alarms if a.role == "outcome")
        policy = sum(1 for a in alarms if a.role == "policy")
        nonfinite = any(a.signal in FINITE_KEYS for a in alarms)
        self.policy_in_run = bool(alarms) and (self.policy_in_run or policy >= self.cfg.min_policy_alarms)
        meets = nonfinite or (outcome >= 1 and self.policy_in_run)
        self.streak = self.streak + 1 if meets else 0
        if meets and (self.streak >= self.cfg.patience or nonfinite or stall):
            return Verdict(step, "collapse", alarms, infra)
        if not meets and not stall:
            self._remember(step, values)
        return Verdict(step, "alarm" if alarms else "healthy", alarms, infra)

    def _rollout_side(self, name: str) -> bool:
        return next(s for s in self.signals if s.name == name).key.startswith("health/")

    def rewind(self, step: int) -> None:
        """Forget what was learned after `step` (the run went back to its checkpoint)."""
        self.history = [(s, v) for s, v in self.history if s <= step]
        self.streak, self.policy_in_run = 0, False

    def _remember(self, step: int, values: dict[str, float]) -> None:
        self.history.append((step, values))
        # Keep only what the window can use.
        del self.history[:-max(self.cfg.window, self.cfg.min_history)]

    def _test(self, s: Signal, x: float | None) -> Alarm | None:
        past = [v[s.name] for _, v in self.history[-self.cfg.window:] if s.name in v]
        if x is None or len(past) < max(s.min_history, self.cfg.min_history):
            return None
        m = statistics.median(past)
        spread = 1.4826 * statistics.median(abs(v - m) for v in past)
        limit = max(self.cfg.mad_k * spread, s.floor + s.rel_floor * abs(m))
        change = {"up": x - m, "down": m - x, "both": abs(x - m)}[s.bad]
        return Alarm(s.name, x, m, limit, s.role) if change > limit else None


def replay(rows: list[Mapping[str, Any]], cfg: DetectorConfig | None = None) -> list[Verdict]:
    """The verdicts a detector gives on recorded metrics rows, in order. It rolls back
    nothing itself; where the recorded run rolled back (a `guard/event` row), it forgets
    what came after the step the run went back to, as that run's detector did."""
    d, out = Detector(cfg or DetectorConfig()), []
    for i, r in enumerate(rows):
        step = metric(r, "step")
        out.append(d.judge(int(step) if step is not None else i + 1, r, stall=STALL in r))
        if EVENT in r and (event := GuardEvent.model_validate(r[EVENT])).kind == GuardEventKind.ROLLBACK:
            d.rewind(int(event.to_step or 0))
    return out


def _is_finite(v: Any) -> bool:
    # metrics.jsonl writes NaN / inf as strings ("nan", "inf").
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return True  # not a number at all: nothing to judge


def _round(v: float) -> float | str:
    return round(v, 4) if math.isfinite(v) else str(v)  # JSON has no NaN / inf
