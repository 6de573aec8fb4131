"""Progress bars of `tmax learn`, drawn with rich from what the run reports
(`training.report.LearnProgress`): the task environments being resolved, then the steps
with their ETA and key figures."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn


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

    def update(self, step: int, info: dict[str, str]) -> None:
        if self.steps is not None:
            self.bar.update(self.steps, completed=step, info="  ".join(f"{k} {v}" for k, v in info.items()))

    def note(self, text: str) -> None:
        self.bar.console.print(text)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
            self.live = False


def learn_progress(enabled: bool) -> RichLearnProgress | None:
    """The bars of a run people watch; None for logs only (`--no-progress`, `--json`)."""
    return RichLearnProgress() if enabled else None
