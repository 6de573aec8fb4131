"""Progress bars, drawn with rich: `tmax learn`'s from what the run reports
(`training.report.LearnProgress`): the task environments being resolved, then the steps
with their ETA and key figures (at a terminal; a log gets a line per step instead,
`training.report.StepLines`); `tmax data`'s corpus jobs with their rate and ETA."""

from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

from tmax.training.report import LearnProgress, StepFigures, StepLines


class RichLearnProgress:
    """A `training.report.LearnProgress` on the terminal. The display starts at the first
    report and stops when the environments are done (before training) or at `close`."""

    def __init__(self) -> None:
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            TextColumn("{task.fields[info]}"))
        self.live = False
        self.envs: TaskID | None = None
        self.steps: TaskID | None = None
        self.heldouts: dict[str, float] = {}

    def _start(self) -> None:
        if not self.live:
            self.bar.start()
            self.live = True

    def environments(self, done: int, total: int) -> None:
        self._start()
        if self.envs is None:
            self.envs = self.bar.add_task("task environments", total=total, info="")
        self.bar.update(self.envs, completed=done)
        if done >= total:
            self.bar.remove_task(self.envs)
            self.envs = None
            if self.steps is None:
                self.close()

    def begin(self, total: int, done: int) -> None:
        self._start()
        self.steps = self.bar.add_task("learn", total=total, completed=done, info="waiting for the first batch")

    def update(self, step: StepFigures) -> None:
        if self.steps is not None:
            shown = {**{f"held-out {k}": f"{v:.1%}" for k, v in self.heldouts.items()}, **step.figures}
            self.bar.update(self.steps, completed=step.step, info="  ".join(f"{k} {v}" for k, v in shown.items()))

    def heldout(self, name: str, pass_rate: float) -> None:
        self.heldouts[name] = pass_rate

    def note(self, text: str) -> None:
        self.bar.console.print(text)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
            self.live = False


def learn_progress(bars: bool, log: Callable[[str], None] | None = None) -> LearnProgress:
    """The bars of a run people watch at a terminal; else (`--no-progress`, `--json`, stderr
    not a terminal) a line per step, through `log` (default: stderr)."""
    if bars:
        return RichLearnProgress()
    return StepLines(log) if log is not None else StepLines()


class _TasksPerHour(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed * 3600:.0f} tasks/h" if task.speed else "-- tasks/h", style="cyan")


def task_jobs_bar(total: int, label: str, console: Console) -> tuple[Progress, TaskID]:
    """A corpus job's bar: tasks done / total, the rate in tasks per hour and the ETA."""
    bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), _TasksPerHour(),
                   TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                   console=console)
    return bar, bar.add_task(label, total=total, info="")
