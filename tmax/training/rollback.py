"""The collapse guard inside a running `tmax learn` loop (`training.trainer.Trainer`).

`training.guard` decides; this module acts. Each finished step, `RunGuard.after_step`
adds the rollout-side health signals (`health/*`) to the step's metrics and, with
`[guard] enabled`, asks the detector for a verdict. While the run is healthy it marks
checkpoints "healthy" once `confirm_steps` clean steps have followed them (by then every
episode sampled from those weights has been judged). On a collapse it:

1. drops the step (it is logged with its `guard/event`, but never checkpointed),
2. marks every checkpoint after the newest healthy one "collapsed" and restores that one
   on the learner ranks (weights, optimizer, RNG) and the engines,
3. applies the remedy (LR x `lr_factor`, group size x `group_factor`, or only skipping the
   offending data: every episode sampled after the healthy checkpoint is dropped anyway),
4. continues from the healthy step with new prompts.

A policy that collapses fails every episode, so its groups have no reward variance and no
batch ever fills: `RunGuard.on_stall` judges the episodes gathered since the last step
every `stall_groups` zero-variance groups in a row, with the same rule.

After `max_rollbacks` rollbacks the next collapse stops the run, back on the healthy
checkpoint, with a "stop" event. Events print as they happen and land in metrics.jsonl
(`guard/event`), the run summary and the reward curve (`training.report`).
"""

from __future__ import annotations

from typing import Any

from tmax.common.records import AlarmRecord, GuardEvent, GuardEventKind, GuardState, HealthMark
from tmax.training.algo.batching import BatchAccumulator
from tmax.training.guard import EVENT, STALL, Detector, Verdict
from tmax.training.learner import checkpoint as ckpt
from tmax.training.report import describe_event, health_metrics


def _step_of(path) -> int:
    return int(path.name.removeprefix("step_"))


class RunGuard:
    """The guard of one `Trainer` (a no-op apart from the health metrics when disabled)."""

    def __init__(self, trainer: Any):
        cfg = trainer.cfg
        self.cfg, self.enabled = cfg.guard, cfg.guard.enabled
        self.detector = Detector(cfg.guard.detector())
        self.confirm = cfg.guard.confirm_steps or cfg.algo.async_steps + 1
        self.rollbacks, self.lr_scale, self.group_size = 0, 1.0, cfg.algo.group_size
        self.bad_steps: list[int] = []  # steps with any alarm: checkpoints around them stay unconfirmed
        self.stopped: str | None = None
        self._requeued = 0  # the loop's re-queue count at the last step

    # -- the loop's calls ------------------------------------------------------------------

    def begin(self, t: Any) -> None:
        """Before the first step: a fresh run's starting weights are checkpoint 0, healthy
        by definition; a resumed run takes back its remedies."""
        if not self.enabled:
            return
        if t.start_step == 0:
            ckpt.mark_health(t.save(0), HealthMark.HEALTHY, {"step": 0, "why": "the run's starting weights"})
            return
        path = ckpt.checkpoint_path(t.run_dir, t.start_step)
        saved = ckpt.checkpoint_meta(path).extra.guard
        self.rollbacks = saved.rollbacks
        self.group_size = t.cfg.algo.group_size = saved.group_size or self.group_size
        self.lr_scale = saved.lr_scale
        if self.lr_scale != 1.0:
            import ray

            ray.get(t.actors.learner.restore(str(path), self.lr_scale))

    def state(self) -> GuardState:
        """What a checkpoint keeps so that a resumed run keeps its remedies."""
        return GuardState(rollbacks=self.rollbacks, lr_scale=self.lr_scale, group_size=self.group_size)

    def after_step(self, t: Any, metrics: dict[str, Any]) -> bool:
        """Health signals into `metrics`; with the guard on, the verdict on the step just
        trained. True when it was a collapse (the run went back, or stopped)."""
        s = t.state
        metrics.update(health_metrics(s.since_step, s.requeued - self._requeued))
        self._requeued = s.requeued
        if not self.enabled:
            return False
        v = self.detector.judge(s.step, metrics)
        metrics["guard/alarms"] = float(len(v.alarms))
        if v.status == "infra":
            t.bar.note(f"guard: {v.describe()}")
        if not v.collapse:
            self._confirm(t.run_dir, v)
            return False
        self._act(t, v, metrics, steps_lost=s.step - self._target_step(t))
        return True

    def on_stall(self, t: Any) -> bool:
        """Every `stall_groups` zero-variance groups in a row: judge the episodes gathered
        since the last step. True when that was a collapse (logged here: no step ran)."""
        s = t.state
        if not self.enabled or not s.useless or s.useless % self.cfg.stall_groups:
            return False
        row = health_metrics(s.since_step, s.requeued - self._requeued)
        v = self.detector.judge(s.step + 1, row, stall=True)
        if not v.collapse:
            return False
        in_flight = s.train_ref is not None
        if in_flight:  # a step of the collapsing policy still training: dropped too
            import ray

            ray.get(s.train_ref)
            s.train_ref = None
        attempted = s.step + 1
        row.update({STALL: 1.0, "guard/alarms": float(len(v.alarms))})
        self._act(t, v, row, steps_lost=s.step + int(in_flight) - self._target_step(t))
        t.sink.log(attempted, row)
        return True

    # -- acting on a collapse ----------------------------------------------------------------

    def _target_step(self, t: Any) -> int:
        target = ckpt.latest_checkpoint(t.run_dir, healthy_only=True)
        return _step_of(target) if target is not None else 0

    def _confirm(self, run_dir, v: Verdict) -> None:
        if v.status not in ("healthy", "warming"):
            self.bad_steps.append(v.step)
            return
        for p in ckpt.list_checkpoints(run_dir):
            k = _step_of(p)
            if (ckpt.health(p) is None and v.step >= k + self.confirm
                    and not any(k < b <= k + self.confirm for b in self.bad_steps)):
                ckpt.mark_health(p, HealthMark.HEALTHY, {"step": k, "confirmed_at": v.step})

    def _act(self, t: Any, v: Verdict, metrics: dict[str, Any], steps_lost: int) -> None:
        """Back to the newest healthy checkpoint; a remedy and on, or a stop."""
        target = ckpt.latest_checkpoint(t.run_dir, healthy_only=True)
        alarms = [AlarmRecord(**a.as_dict()) for a in v.alarms]
        if target is None:  # the guard was switched on in the middle of a run
            self.stopped = "a collapse was detected and no checkpoint is marked healthy"
            event = GuardEvent(kind=GuardEventKind.STOP, step=v.step, reason=self.stopped, alarms=alarms)
        else:
            to_step = _step_of(target)
            for p in ckpt.list_checkpoints(t.run_dir):
                if _step_of(p) > to_step:
                    ckpt.mark_health(p, HealthMark.COLLAPSED, {"step": _step_of(p), "detected_at": v.step})
            if self.rollbacks >= self.cfg.max_rollbacks:
                self.stopped = (f"a collapse after {self.rollbacks} rollbacks (guard.max_rollbacks); the run "
                                f"stays at step {to_step}, its last healthy checkpoint")
                event = GuardEvent(kind=GuardEventKind.STOP, step=v.step, to_step=to_step, reason=self.stopped,
                                   alarms=alarms)
            else:
                self.rollbacks += 1
                self._remedy(t)
                event = GuardEvent(kind=GuardEventKind.ROLLBACK, step=v.step, to_step=to_step, steps_lost=steps_lost,
                                   remedy=self.cfg.remedy, lr_scale=self.lr_scale, group_size=self.group_size,
                                   rollback=self.rollbacks, alarms=alarms)
            self._restore(t, str(target), to_step)
        metrics[EVENT] = event.model_dump(mode="json")
        metrics["guard/rollback"] = 1.0 if event.kind == GuardEventKind.ROLLBACK else 0.0
        t.bar.note(f"guard: {describe_event(event)}: " + "; ".join(a.describe() for a in v.alarms))

    def _remedy(self, t: Any) -> None:
        if self.cfg.remedy == "lower_lr":
            self.lr_scale *= self.cfg.lr_factor
        elif self.cfg.remedy == "raise_group_size":
            self.group_size *= self.cfg.group_factor
            t.cfg.algo.group_size = self.group_size
        # "skip_batch": the restore below already drops every episode sampled since.

    def _restore(self, t: Any, path: str, to_step: int) -> None:
        """Learner ranks and engines on checkpoint `path`; every episode and group of the
        collapsed policy dropped; the loop continues from `to_step` with new prompts."""
        import ray

        s = t.state
        ray.get(t.actors.learner.restore(path, self.lr_scale))
        for ref in list(s.pending):  # results of the collapsed policy: never read
            ray.cancel(ref, force=False)
        s.pending.clear()
        s.queue.clear()
        s.groups.clear()
        s.ready.clear()
        s.since_step = []
        s.useless = 0
        t.acc = BatchAccumulator(t.acc.cfg)
        s.step = s.version = to_step
        self.detector.rewind(to_step)
        self.bad_steps = [b for b in self.bad_steps if b <= to_step]
        t.sync.push(to_step)
        a = t.cfg.algo
        for _ in range(a.prompts_per_step * max(1, a.async_steps)):
            t.open_prompt()
