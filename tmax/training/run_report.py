"""`tmax learn report RUN`: a run at a glance, as one typed record read from the run's
files (`RunReport.read`): the held-out pass rates before and after RL and the time of
each stage (a recipe directory's `recipe.json`), the RL steps' reward path, throughput
(episodes a minute, sampled tokens a second, learner tokens a second) and the collapse
guard's events (`metrics.jsonl`). `tmax.cli.learn_report` renders it; `--json` prints it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tmax.common.errors import ConfigError
from tmax.common.records import GuardSummary, LearnRunDir, RunSummary, metric, metric_values, read_record
from tmax.training.report import guard_summary, read_metrics

# A recipe's stages in the order they run (`training.entry.recipe`'s `times` keys).
STAGES = ("build_s", "environments_s", "sft_s", "engine_start_s", "sft_eval_s", "rl_s", "rl_eval_s")


class Throughput(BaseModel):
    """Rates over the RL loop's wall time (the steps of the last process of a resumed run)."""

    episodes_per_min: float | None = None
    sampled_tokens_per_s: float | None = None  # tokens the policy sampled, over the loop's wall
    learner_tokens_per_s: float | None = None  # tokens the learner trained on, over its busy time


class RunReport(BaseModel):
    run_dir: str
    recipe: bool  # a `tmax learn nano` directory (recipe.json): held-out figures and stage times
    seed: int | None = None
    heldout_before: float | None = None  # pass rate of the checkpoint RL started from
    heldout_after: float | None = None  # pass rate of RL's final checkpoint
    stage_seconds: dict[str, float] = {}  # stage -> seconds, in the order the stages ran
    stage_cpu_seconds: dict[str, float] = {}  # stage -> CPU seconds of the run's processes (a recipe's)
    steps: int = 0  # the run's last logged step
    updates: int = 0  # steps trained, rolled-back ones included
    episodes: int = 0
    rewards: list[float | None] = []  # training reward of each logged step, in order: the curve's path
    throughput: Throughput = Throughput()
    guard: GuardSummary = GuardSummary()

    @property
    def gain_points(self) -> float | None:
        if self.heldout_before is None or self.heldout_after is None:
            return None
        return round(100 * (self.heldout_after - self.heldout_before), 1)

    @classmethod
    def read(cls, run_dir: Path) -> RunReport:
        """The report of a `tmax learn` run directory or a recipe directory (its RL run in
        `rl/`); a directory with neither metrics nor a recipe result is a `ConfigError`."""
        files = LearnRunDir(run_dir)
        recipe_file = files.recipe
        found = next((d for d in (files, files.rl) if d.metrics.is_file()), None)
        metrics = found.metrics if found is not None else None
        if metrics is None and not recipe_file.is_file():
            raise ConfigError(f"no metrics.jsonl in {run_dir} (or {run_dir / 'rl'}) and no recipe.json: "
                              "not a `tmax learn` run directory")
        report = cls(run_dir=str(run_dir), recipe=recipe_file.is_file())
        if metrics is not None:
            report = report.model_copy(update=_rl_figures(read_metrics(metrics)))
            summary = found.summary
            if summary.is_file() and not report.recipe:
                times = read_record(summary, RunSummary)
                report.stage_seconds = {"setup_s": times.setup_s, "rl_s": times.run_s}
        if report.recipe:
            from tmax.training.recipe import RecipeResult

            res = RecipeResult.model_validate_json(recipe_file.read_text())
            report.seed, report.heldout_before, report.heldout_after = res.seed, res.sft_pass_rate, res.rl_pass_rate
            report.stage_seconds = {k: res.times[k] for k in (*STAGES, "total_s") if k in res.times}
            report.stage_cpu_seconds = {k: res.cpu_times[k] for k in report.stage_seconds if k in res.cpu_times}
        return report


def _rl_figures(logged: list[dict]) -> dict[str, Any]:
    """Steps, episodes, the reward path, throughput and guard events of metrics rows."""
    rows = [r for r in logged if "guard/stall" not in r]  # a judged stall is not a step
    if not rows:
        return {"guard": guard_summary(logged)}
    last = rows[-1]
    wall = metric(last, "time/total")
    episodes = int(metric(last, "episode") or 0)
    sampled, train_s = metric_values(rows, "perf/sampled_tokens"), sum(metric_values(rows, "time/training"))
    learner_tokens = sum(metric_values(rows, "learner/tokens"))
    rewards = [metric(r, "train/reward_all_rollouts") for r in rows]
    return {
        "steps": int(last["step"]), "updates": len(rows), "episodes": episodes,
        "rewards": [round(x, 4) if isinstance(x, (int, float)) else None for x in rewards],
        "throughput": Throughput(
            episodes_per_min=round(60 * episodes / wall, 1) if wall else None,
            sampled_tokens_per_s=round(sum(sampled) / wall, 1) if wall and len(sampled) == len(rows) else None,
            learner_tokens_per_s=round(learner_tokens / train_s, 1) if train_s else None),
        "guard": guard_summary(logged),
    }
