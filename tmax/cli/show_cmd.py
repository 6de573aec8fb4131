"""`tmax show PATH`: replay a saved run with the same step rendering as `tmax run`.

PATH is a run directory, a trial directory (its `agent/`: tmax bench or Harbor), or a
trajectory file. The trajectory is chat messages (`tmax run`) or ATIF from any harness
(tmax, mini-swe, terminus-2, Harbor's own agents), told apart by its content. Chat
messages are parsed with the harness the run used (run.json's `harness`); ATIF steps
carry their actions as tool calls, which are shown as they are. A trial directory's
result.json (`tasks.harbor.TrialResult`) adds what the trial scored. The session's own
files are read as their records (`common.records`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from pydantic import BaseModel

from tmax.agents.compaction import CompactionRecord, SessionContext
from tmax.common.records import (EpisodeOutcome, R, RecordError, RunRecord, SessionDir, StepTiming, TimingRecords,
                                 UsageRecord, read_record)

if TYPE_CHECKING:
    from tmax.cli.ui import Display


class ShowError(ValueError):
    pass


def _read_json(path: Path, required: bool) -> Any:
    if not path.exists():
        if required:
            raise ShowError(f"{path} does not exist")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ShowError(f"{path} is not readable JSON: {e}") from e


class TrialScore(BaseModel):
    """What a trial (tmax bench's or Harbor's) scored, from its result.json."""

    task: str
    agent: str | None
    outcome: str
    reward: float | None
    passed: bool


class ShownRun(BaseModel):
    """A saved run as `tmax show` reads it (`--json` prints it, unset fields left out)."""

    dir: str
    trajectory: list[dict[str, Any]]  # chat messages, from ATIF where the run kept that
    format: str | None = None  # "atif": the trajectory file was ATIF
    timing: list[StepTiming] = []
    usage: UsageRecord | None = None
    outcome: EpisodeOutcome | None = None  # how the agent loop ended
    run: RunRecord | None = None  # `tmax run`'s record; the ATIF's agent and model otherwise
    trial: TrialScore | None = None
    segments: list[tuple[int, list[dict[str, Any]]]] = []  # (segment, its messages) a compaction closed
    compactions: list[CompactionRecord] = []


def _from_atif(doc: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], RunRecord]:
    from tmax.agents.atif import from_atif

    try:
        messages = from_atif(doc)
    except (ValueError, KeyError, TypeError) as e:
        raise ShowError(f"{path} is not an ATIF trajectory: {e}") from e
    agent = doc.get("agent") or {}  # ATIF (Harbor's format), whoever wrote it
    return messages, RunRecord(harness=agent.get("name"), model=agent.get("model_name"))


def _run_dir(path: Path) -> Path:
    """The directory holding the run's files: PATH itself, or a trial's agent/ (tmax bench,
    Harbor), or the directory of a named file."""
    if path.is_file():
        return path.parent
    if not SessionDir(path).trajectory.exists() and (path / "agent").is_dir():
        return path / "agent"
    return path


def _messages(doc: Any, where: Path) -> tuple[list[dict[str, Any]], RunRecord | None]:
    """Chat messages from a trajectory file, whatever wrote it: a list of messages, an object
    with "messages", or ATIF (any harness); the format is read from the content."""
    if isinstance(doc, dict) and isinstance(doc.get("steps"), list):
        return _from_atif(doc, where)
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
        doc = doc["messages"]
    if not isinstance(doc, list) or not all(isinstance(m, dict) and "role" in m for m in doc):
        raise ShowError(f"{where} is not a trajectory (expected a list of chat messages or ATIF steps)")
    return doc, None


def _record(path: Path, model: type[R]) -> R | None:
    """The record in `path` (None when there is none); a broken one is a `ShowError`."""
    if not path.is_file():
        return None
    try:
        return read_record(path, model)
    except (RecordError, OSError) as e:
        raise ShowError(str(e)) from e


def load_run(path: Path) -> ShownRun:
    """The saved files of a run directory, a trial directory (its agent/), or one trajectory
    file; chat messages or ATIF, told apart by content."""
    from tmax.agents.atif import ATIF_FILE
    from tmax.agents.recorder import load_segments

    if not path.exists():
        raise ShowError(f"{path} does not exist")
    run_dir = _run_dir(path)
    files = SessionDir(run_dir)
    traj_file = path if path.is_file() else files.trajectory
    if path.is_dir() and not traj_file.exists() and (run_dir / ATIF_FILE).exists():
        traj_file = run_dir / ATIF_FILE  # tmax bench trials before trajectory.json became ATIF
    messages, atif_meta = _messages(_read_json(traj_file, required=True), traj_file)
    is_atif = atif_meta is not None
    if is_atif and path.is_dir() and files.messages.is_file():
        # A tmax bench trial keeps the messages exactly as sent beside the ATIF: show those.
        messages = _messages(_read_json(files.messages, required=True), files.messages)[0]
        is_atif = False
    if files.timing.is_file() and not isinstance(_read_json(files.timing, required=True), list):
        raise ShowError(f"{files.timing} should hold a list of per-step records")
    timing = _record(files.timing, TimingRecords)
    context = _record(files.compaction, SessionContext)
    try:
        segments = [(s.segment, s.messages) for s in load_segments(run_dir)]
    except (ValueError, KeyError, TypeError) as e:
        raise ShowError(f"{files.segments} holds a broken segment: {e}") from e
    try:
        outcome = files.read_outcome()
    except RecordError as e:
        raise ShowError(str(e)) from e
    return ShownRun(dir=str(run_dir), trajectory=messages, format="atif" if is_atif else None,
                    timing=timing.root if timing is not None else [], usage=_record(files.usage, UsageRecord),
                    outcome=outcome, run=_record(files.run, RunRecord) or atif_meta,
                    trial=_trial_score(path) if run_dir != path else None, segments=segments,
                    compactions=context.compactions if context is not None else [])


def _trial_score(trial_dir: Path) -> TrialScore | None:
    """What a trial (tmax bench's or Harbor's) scored, from its result.json; None where the
    directory holds no trial result."""
    from tmax.tasks.harbor import TrialResult

    r = TrialResult.parse(_read_json(trial_dir / "result.json", required=False))
    if r is None:
        return None
    verdict = r.score()
    return TrialScore(task=r.task_name, agent=r.agent_name, outcome=verdict.outcome, reward=verdict.reward,
                      passed=verdict.passed)


def _text(content: Any) -> str:
    # Content may be a string or a list of OpenAI content parts.
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _call_text(call: dict[str, Any]) -> str:
    """An ATIF tool call as the command it stands for (bash, terminus keystrokes, other tools)."""
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, ValueError):
        args = {"raw": fn.get("arguments")}
    for key in ("command", "keystrokes", "cmd"):
        if isinstance(args, dict) and isinstance(args.get(key), str):
            return args[key]
    return f"{fn.get('name') or '?'}({json.dumps(args) if args else ''})"


def _show_meta(run: ShownRun, display: Display) -> None:
    meta = run.run
    if meta is None:
        return
    named = {"model": meta.model, "harness": meta.harness, "sandbox": meta.sandbox, "mode": meta.mode,
             "format": run.format}
    bits = [f"{k} {v}" for k, v in named.items() if v]
    if meta.resumed_from:
        bits.append(f"resumed from {meta.resumed_from}")
    display.info(" · ".join(bits))


class _Replay:
    """Renders messages one at a time, carrying what a step needs across the segments of
    a compacted session (the step count, what the next user message answers)."""

    def __init__(self, run: ShownRun, display: Display, show_system: bool) -> None:
        from tmax.agents.harnesses import HARNESSES, make_harness

        self.display, self.show_system = display, show_system
        self.meta = run.run or RunRecord()
        self.timing = {t.step: t for t in run.timing if t.step is not None}
        # ATIF pairs each action with its observation already: its tool calls are shown as they
        # are, whatever the harness (Harbor's terminus-2 has no tool calls in its model's replies).
        self.atif = run.format == "atif"
        self.harness = make_harness(self.meta.harness if self.meta.harness in HARNESSES else "tmax")
        # What the next user message answers: an action given as text ("observation") or a
        # response without a usable action ("format_error"); tool calls get tool messages.
        self.pending: str | None = None
        self.step = 0
        self.seen_task = False

    def message(self, msg: dict[str, Any]) -> None:
        from tmax.cli.ui import split_exit_code

        role, content, display = msg.get("role"), _text(msg.get("content")), self.display
        answers, self.pending = self.pending, (self.pending if role == "system" else None)
        t = self.timing.get(self.step) or StepTiming()
        if role == "system":
            if self.show_system:
                display.feedback(content, "system prompt")
        elif role == "user":
            self._user(content, answers, t)
        elif role == "assistant":
            self._assistant(msg, content)
        elif role == "tool":
            body, code = split_exit_code(content)
            display.output(body, t.return_code if code is None else code, t.bash_s)

    def _user(self, content: str, answers: str | None, t: StepTiming) -> None:
        if not self.seen_task:
            # The first user message wraps the task in the instance template; show the
            # task as typed when `tmax run` recorded it.
            typed = self.meta.task if not self.meta.resumed_from else None  # a resume's task is its follow-up
            self.display.task(typed or content)
            self.seen_task = True
        elif answers == "observation":
            self.display.output(content, t.return_code, t.bash_s)
        elif answers == "format_error" or content.startswith("Format error"):
            self.display.format_error(content)
        else:
            # A rejected command's reason, guidance or a follow-up task.
            self.display.feedback(content, "user")

    def _assistant(self, msg: dict[str, Any], content: str) -> None:
        display = self.display
        self.step += 1
        display.step_header(self.step)
        display.thought(content)
        if self.atif:
            for call in msg.get("tool_calls") or []:
                display.command(_call_text(call))
            self.pending = "observation"
            return
        action = self.harness.parse(msg)
        self.pending = "format_error" if action.command is None else (None if action.tool_call_id else "observation")
        if action.command is not None:
            display.command(action.command)
        else:
            display.warn(f"(no valid bash call: {action.error})")
        t = self.timing.get(self.step)
        if t is not None and t.llm_s is not None:
            display.note(f"model {t.llm_s}s")


def _parts(run: ShownRun) -> list[tuple[list[dict[str, Any]], CompactionRecord | None]]:
    """(messages to show, the compaction that ended them or None) per context of the run:
    the segments compactions closed, then trajectory.json. A context that follows one shown
    here starts with what its compaction carried and kept, shown already (a resumed run's
    first context starts with it too, and is shown whole)."""
    done = {c.segment: c for c in run.compactions if c.ok}
    contexts = [*run.segments, (len(done) + 1, run.trajectory)]
    shown = {n for n, _ in contexts}
    parts = []
    for n, messages in contexts:
        start = done.get(n - 1) if n - 1 in shown else None
        skip = start.prefix + start.kept_messages if start is not None else 0
        parts.append((messages[skip:], done.get(n)))
    return parts


def render(run: ShownRun, display: Display, show_system: bool = False) -> None:
    _show_meta(run, display)
    replay = _Replay(run, display, show_system)
    for messages, compaction in _parts(run):
        for msg in messages:
            replay.message(msg)
        if compaction is not None:
            display.compaction(compaction)
    display.info(" · ".join(_summary(run, replay.step)))
    error = (run.outcome.error if run.outcome else None) or (run.run.error if run.run else None)
    if error:
        display.warn(f"error: {error}")


def _summary(run: ShownRun, steps: int) -> list[str]:
    """The closing line's parts: what the trial scored, the agent's status, steps, tokens."""
    from tmax.cli.ui import fmt_tokens

    summary = [f"{steps} steps"]
    status = run.outcome.status if run.outcome else (run.run.status if run.run and "status" in run.run.model_fields_set
                                                     else None)
    if status:
        summary.insert(0, str(status))
    trial = run.trial
    if trial:
        reward = "-" if trial.reward is None else f"{trial.reward:g}"
        summary.insert(0, f"trial {trial.outcome}, reward {reward}")
    compactions = [c for c in run.compactions if c.ok]
    if compactions:
        summary.append(f"{len(compactions)} compaction{'s' if len(compactions) > 1 else ''}")
    usage = run.usage
    if usage:
        summary.append(f"tokens: {fmt_tokens(usage.prompt_tokens)} prompt, {fmt_tokens(usage.completion_tokens)} completion")
    return summary

def show(
    path: Path = typer.Argument(..., help="A run directory, a trial directory, or a trajectory file "
                                          "(chat messages or ATIF)."),
    json_mode: bool = typer.Option(False, "--json", help="Print the saved files as one JSON object instead."),
    system: bool = typer.Option(False, "--system", help="Also show the system prompt."),
    export: Optional[str] = typer.Option(
        None, "--export", help="messages: print Hugging Face chat JSONL, one line per run under PATH (for other trainers)."
    ),
) -> None:
    """Render a saved run step by step."""
    if export is not None:
        _export(path, export)
        return
    try:
        run = load_run(path)
    except ShowError as e:
        typer.secho(f"tmax show: {e}", err=True, fg="red")
        raise typer.Exit(2) from None
    if json_mode:
        typer.echo(run.model_dump_json(indent=2, exclude_unset=True))
        return
    from tmax.cli.ui import Display

    render(run, Display(), show_system=system)


def _export(path: Path, kind: str) -> None:
    from tmax.cli.export_messages import export_line, session_dirs

    if kind != "messages":
        typer.secho(f"tmax show: --export {kind!r}: the one format is 'messages'", err=True, fg="red")
        raise typer.Exit(2)
    dirs = session_dirs(path) if path.is_dir() else []
    if not dirs:
        typer.secho(f"tmax show: no run (trajectory.json) under {path}", err=True, fg="red")
        raise typer.Exit(2)
    for d in dirs:
        try:
            run = load_run(d)
            # A compacted session: one conversation per context, as the model saw each.
            for messages in [*(m for _, m in run.segments), run.trajectory]:
                typer.echo(export_line(messages))
        except ShowError as e:
            typer.secho(f"tmax show: {e}", err=True, fg="red")
            raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("show")(show)
