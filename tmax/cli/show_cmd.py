"""`tmax show PATH`: replay a saved run with the same step rendering as `tmax run`.

PATH is a run directory, a trial directory (its `agent/`: tmax bench or Harbor), or a
trajectory file. The trajectory is chat messages (`tmax run`) or ATIF from any harness
(tmax, mini-swe, terminus-2, Harbor's own agents), told apart by its content. Chat
messages are parsed with the harness the run used (run.json's `harness`); ATIF steps
carry their actions as tool calls, which are shown as they are. A trial directory's
result.json (`tasks.harbor.TrialResult`) adds what the trial scored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer


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


def _from_atif(doc: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from tmax.agents.atif import from_atif

    try:
        messages = from_atif(doc)
    except (ValueError, KeyError, TypeError) as e:
        raise ShowError(f"{path} is not an ATIF trajectory: {e}") from e
    agent = doc.get("agent") or {}
    meta = {"harness": agent.get("name"), "model": agent.get("model_name"), "format": "atif"}
    return messages, {k: v for k, v in meta.items() if v}


def _run_dir(path: Path) -> Path:
    """The directory holding the run's files: PATH itself, or a trial's agent/ (tmax bench,
    Harbor), or the directory of a named file."""
    if path.is_file():
        return path.parent
    if not (path / "trajectory.json").exists() and (path / "agent").is_dir():
        return path / "agent"
    return path


def _messages(doc: Any, where: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Chat messages from a trajectory file, whatever wrote it: a list of messages, an object
    with "messages", or ATIF (any harness); the format is read from the content."""
    if isinstance(doc, dict) and isinstance(doc.get("steps"), list):
        return _from_atif(doc, where)
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
        doc = doc["messages"]
    if not isinstance(doc, list) or not all(isinstance(m, dict) and "role" in m for m in doc):
        raise ShowError(f"{where} is not a trajectory (expected a list of chat messages or ATIF steps)")
    return doc, {}


def load_run(path: Path) -> dict[str, Any]:
    """The saved files of a run directory, a trial directory (its agent/), or one trajectory
    file; chat messages or ATIF, told apart by content."""
    from tmax.agents.atif import ATIF_FILE
    from tmax.agents.records import MESSAGES

    if not path.exists():
        raise ShowError(f"{path} does not exist")
    run_dir = _run_dir(path)
    traj_file = path if path.is_file() else run_dir / "trajectory.json"
    if path.is_dir() and not traj_file.exists() and (run_dir / ATIF_FILE).exists():
        traj_file = run_dir / ATIF_FILE  # tmax bench trials before trajectory.json became ATIF
    messages, atif_meta = _messages(_read_json(traj_file, required=True), traj_file)
    if atif_meta and path.is_dir() and (run_dir / MESSAGES).is_file():
        # A tmax bench trial keeps the messages exactly as sent beside the ATIF: show those.
        messages = _messages(_read_json(run_dir / MESSAGES, required=True), run_dir / MESSAGES)[0]
        atif_meta.pop("format")
    timing = _read_json(run_dir / "timing.json", required=False) or []
    if not isinstance(timing, list):
        raise ShowError(f"{run_dir / 'timing.json'} should hold a list of per-step records")
    usage = _read_json(run_dir / "usage.json", required=False) or {}
    meta = _read_json(run_dir / "run.json", required=False) or {}  # written by `tmax run`
    meta = {**atif_meta, **meta}
    result = _read_json(run_dir / "result.json", required=False) or {}  # written by the agent
    trial = _trial_score(path) if run_dir != path else None
    return {"dir": str(run_dir), "trajectory": messages, "timing": timing, "usage": usage, "result": result, "run": meta,
            "trial": trial, **_compacted(run_dir)}


def _compacted(run_dir: Path) -> dict[str, Any]:
    """A compacted session's closed segments and its compactions ([] and [] otherwise)."""
    from tmax.agents.records import COMPACTION, load_segments

    try:
        segments = [{"segment": s.segment, "messages": s.messages} for s in load_segments(run_dir)]
    except (ValueError, KeyError, TypeError) as e:
        raise ShowError(f"{run_dir / 'segments'} holds a broken segment: {e}") from e
    context = _read_json(run_dir / COMPACTION, required=False) or {}
    return {"segments": segments, "compactions": list(context.get("compactions") or [])}


def _trial_score(trial_dir: Path) -> dict[str, Any] | None:
    """What a trial (tmax bench's or Harbor's) scored, from its result.json; None where the
    directory holds no trial result."""
    from tmax.tasks.harbor import TrialResult

    r = TrialResult.parse(_read_json(trial_dir / "result.json", required=False))
    if r is None:
        return None
    verdict = r.score()
    return {"task": r.task_name, "agent": r.agent_name, "outcome": verdict.outcome, "reward": verdict.reward,
            "passed": verdict.passed}


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


def _show_meta(meta: dict[str, Any], display: Any) -> None:
    if meta:
        bits = [f"{k} {meta[k]}" for k in ("model", "harness", "sandbox", "mode", "format") if meta.get(k)]
        if meta.get("resumed_from"):
            bits.append(f"resumed from {meta['resumed_from']}")
        display.info(" · ".join(bits))


class _Replay:
    """Renders messages one at a time, carrying what a step needs across the segments of
    a compacted session (the step count, what the next user message answers)."""

    def __init__(self, run: dict[str, Any], display: Any, show_system: bool) -> None:
        from tmax.agents.harnesses import HARNESSES, make_harness

        self.display, self.show_system = display, show_system
        self.meta = run["run"]
        self.timing = {t.get("step"): t for t in run["timing"] if isinstance(t, dict)}
        # ATIF pairs each action with its observation already: its tool calls are shown as they
        # are, whatever the harness (Harbor's terminus-2 has no tool calls in its model's replies).
        self.atif = self.meta.get("format") == "atif"
        self.harness = make_harness(self.meta.get("harness") if self.meta.get("harness") in HARNESSES else "tmax")
        # What the next user message answers: an action given as text ("observation") or a
        # response without a usable action ("format_error"); tool calls get tool messages.
        self.pending: str | None = None
        self.step = 0
        self.seen_task = False

    def message(self, msg: dict[str, Any]) -> None:
        from tmax.cli.ui import split_exit_code

        role, content, display = msg.get("role"), _text(msg.get("content")), self.display
        answers, self.pending = self.pending, (self.pending if role == "system" else None)
        t = self.timing.get(self.step) or {}
        if role == "system":
            if self.show_system:
                display.feedback(content, "system prompt")
        elif role == "user":
            self._user(content, answers, t)
        elif role == "assistant":
            self._assistant(msg, content)
        elif role == "tool":
            body, code = split_exit_code(content)
            display.output(body, t.get("return_code") if code is None else code, t.get("bash_s"))

    def _user(self, content: str, answers: str | None, t: dict[str, Any]) -> None:
        if not self.seen_task:
            # The first user message wraps the task in the instance template; show the
            # task as typed when `tmax run` recorded it.
            typed = self.meta.get("task") if not self.meta.get("resumed_from") else None  # a resume's task is its follow-up
            self.display.task(typed or content)
            self.seen_task = True
        elif answers == "observation":
            self.display.output(content, t.get("return_code"), t.get("bash_s"))
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
        t = self.timing.get(self.step) or {}
        if t.get("llm_s") is not None:
            display.note(f"model {t['llm_s']}s")


def _parts(run: dict[str, Any]) -> list[tuple[list[dict[str, Any]], Any]]:
    """(messages to show, the compaction that ended them or None) per context of the run:
    the segments compactions closed, then trajectory.json. A context that follows one shown
    here starts with what its compaction carried and kept, shown already (a resumed run's
    first context starts with it too, and is shown whole)."""
    from tmax.agents.compaction import CompactionRecord

    done = {c.segment: c for c in map(CompactionRecord.model_validate, run["compactions"]) if c.ok}
    contexts = [*((s["segment"], s["messages"]) for s in run["segments"]), (len(done) + 1, run["trajectory"])]
    shown = {n for n, _ in contexts}
    parts = []
    for n, messages in contexts:
        start = done.get(n - 1) if n - 1 in shown else None
        skip = start.prefix + start.kept_messages if start is not None else 0
        parts.append((messages[skip:], done.get(n)))
    return parts


def render(run: dict[str, Any], display: Any, show_system: bool = False) -> None:
    _show_meta(run["run"], display)
    replay = _Replay(run, display, show_system)
    for messages, compaction in _parts(run):
        for msg in messages:
            replay.message(msg)
        if compaction is not None:
            display.compaction(compaction)
    display.info(" · ".join(_summary(run, replay.step)))
    error = (run["result"] or {}).get("error") or (run["run"] or {}).get("error")
    if error:
        display.warn(f"error: {error}")


def _summary(run: dict[str, Any], steps: int) -> list[str]:
    """The closing line's parts: what the trial scored, the agent's status, steps, tokens."""
    from tmax.cli.ui import fmt_tokens

    summary = [f"{steps} steps"]
    status = (run["result"] or {}).get("status") or (run["run"] or {}).get("status")
    if status:
        summary.insert(0, str(status))
    trial = run.get("trial")
    if trial:
        reward = "-" if trial["reward"] is None else f"{trial['reward']:g}"
        summary.insert(0, f"trial {trial['outcome']}, reward {reward}")
    compactions = [c for c in run["compactions"] if c.get("ok")]
    if compactions:
        summary.append(f"{len(compactions)} compaction{'s' if len(compactions) > 1 else ''}")
    usage = run["usage"]
    if usage:
        summary.append(
            f"tokens: {fmt_tokens(int(usage.get('prompt_tokens') or 0))} prompt, "
            f"{fmt_tokens(int(usage.get('completion_tokens') or 0))} completion"
        )
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
        typer.echo(json.dumps(run, indent=2))
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
            for messages in [*(s["messages"] for s in run["segments"]), run["trajectory"]]:
                typer.echo(export_line(messages))
        except ShowError as e:
            typer.secho(f"tmax show: {e}", err=True, fg="red")
            raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("show")(show)
