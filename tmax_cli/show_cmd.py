"""`tmax show PATH`: replay a saved run (trajectory.json + timing.json + usage.json, or an
ATIF trajectory.atif.json) with the same step rendering as `tmax run`, under the harness
the run used (run.json's `harness`, or the ATIF agent name)."""

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


def _load_atif(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from agents.atif import from_atif

    doc = _read_json(path, required=True)
    try:
        messages = from_atif(doc)
    except (ValueError, KeyError, TypeError) as e:
        raise ShowError(f"{path} is not an ATIF trajectory: {e}") from e
    agent = doc.get("agent") or {}
    meta = {"harness": agent.get("name"), "model": agent.get("model_name")}
    return messages, {k: v for k, v in meta.items() if v}


def load_run(path: Path) -> dict[str, Any]:
    """The saved files of a run directory (or of the directory holding a trajectory.json),
    or an ATIF file (read when it is named, or when the directory has no trajectory.json)."""
    from agents.atif import ATIF_FILE

    if not path.exists():
        raise ShowError(f"{path} does not exist")
    run_dir = path if path.is_dir() else path.parent
    traj_file = path if path.is_file() else run_dir / "trajectory.json"
    atif_meta: dict[str, Any] = {}
    if traj_file.name == ATIF_FILE or (path.is_dir() and not traj_file.exists() and (run_dir / ATIF_FILE).exists()):
        messages, atif_meta = _load_atif(run_dir / ATIF_FILE if path.is_dir() else path)
    else:
        messages = _read_json(traj_file, required=True)
    if isinstance(messages, dict) and isinstance(messages.get("messages"), list):
        messages = messages["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ShowError(f"{traj_file} is not a trajectory (expected a list of chat messages)")
    timing = _read_json(run_dir / "timing.json", required=False) or []
    if not isinstance(timing, list):
        raise ShowError(f"{run_dir / 'timing.json'} should hold a list of per-step records")
    usage = _read_json(run_dir / "usage.json", required=False) or {}
    meta = _read_json(run_dir / "run.json", required=False) or {}  # written by `tmax run`
    if not meta.get("harness") and (run_dir / ATIF_FILE).exists() and not atif_meta:
        atif_meta = _load_atif(run_dir / ATIF_FILE)[1]  # a bench trial: the ATIF names the harness
    meta = {**atif_meta, **meta}
    result = _read_json(run_dir / "result.json", required=False) or {}  # written by the agent
    return {"dir": str(run_dir), "trajectory": messages, "timing": timing, "usage": usage, "result": result, "run": meta}


def _text(content: Any) -> str:
    # Content may be a string or a list of OpenAI content parts.
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def render(run: dict[str, Any], display: Any, show_system: bool = False) -> None:
    from agents.harnesses import HARNESSES, make_harness
    from tmax_cli.ui import fmt_tokens, split_exit_code

    messages = run["trajectory"]
    timing = {t.get("step"): t for t in run["timing"] if isinstance(t, dict)}
    meta = run["run"]
    harness = make_harness(meta.get("harness") if meta.get("harness") in HARNESSES else "tmax")
    # What the next user message answers: an action given as text ("observation") or a
    # response without a usable action ("format_error"); tool calls get tool messages.
    pending: str | None = None
    if meta:
        bits = [f"{k} {meta[k]}" for k in ("model", "harness", "sandbox", "mode") if meta.get(k)]
        if meta.get("resumed_from"):
            bits.append(f"resumed from {meta['resumed_from']}")
        display.info(" · ".join(bits))

    step = 0
    seen_task = False
    for msg in messages:
        role = msg.get("role")
        content = _text(msg.get("content"))
        answers, pending = pending, (pending if role == "system" else None)
        if role == "system":
            if show_system:
                display.feedback(content, "system prompt")
        elif role == "user":
            if not seen_task:
                # The first user message wraps the task in the instance template; show the
                # task as typed when `tmax run` recorded it.
                typed = meta.get("task") if not meta.get("resumed_from") else None  # a resume's task is its follow-up
                display.task(typed or content)
                seen_task = True
            elif answers == "observation":
                t = timing.get(step) or {}
                display.output(content, t.get("return_code"), t.get("bash_s"))
            elif answers == "format_error" or content.startswith("Format error"):
                display.format_error(content)
            else:
                # A rejected command's reason, guidance or a follow-up task.
                display.feedback(content, "user")
        elif role == "assistant":
            step += 1
            display.step_header(step)
            display.thought(content)
            action = harness.parse(msg)
            pending = "format_error" if action.command is None else (None if action.tool_call_id else "observation")
            if action.command is not None:
                display.command(action.command)
            else:
                display.warn(f"(no valid bash call: {action.error})")
            t = timing.get(step) or {}
            if t.get("llm_s") is not None:
                display.note(f"model {t['llm_s']}s")
        elif role == "tool":
            body, code = split_exit_code(content)
            t = timing.get(step) or {}
            if code is None:
                code = t.get("return_code")
            display.output(body, code, t.get("bash_s"))
    summary = [f"{step} steps"]
    status = (run["result"] or {}).get("status") or (meta or {}).get("status")
    if status:
        summary.insert(0, str(status))
    usage = run["usage"]
    if usage:
        summary.append(
            f"tokens: {fmt_tokens(int(usage.get('prompt_tokens') or 0))} prompt, "
            f"{fmt_tokens(int(usage.get('completion_tokens') or 0))} completion"
        )
    error = (run["result"] or {}).get("error") or (meta or {}).get("error")
    display.info(" · ".join(summary))
    if error:
        display.warn(f"error: {error}")


def show(
    path: Path = typer.Argument(..., help="A run directory (or its trajectory.json)."),
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
    from tmax_cli.ui import Display

    render(run, Display(), show_system=system)


def _export(path: Path, kind: str) -> None:
    from tmax_cli.export_messages import export_line, session_dirs

    if kind != "messages":
        typer.secho(f"tmax show: --export {kind!r}: the one format is 'messages'", err=True, fg="red")
        raise typer.Exit(2)
    dirs = session_dirs(path) if path.is_dir() else []
    if not dirs:
        typer.secho(f"tmax show: no run (trajectory.json) under {path}", err=True, fg="red")
        raise typer.Exit(2)
    for d in dirs:
        try:
            typer.echo(export_line(load_run(d)["trajectory"]))
        except ShowError as e:
            typer.secho(f"tmax show: {e}", err=True, fg="red")
            raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("show")(show)
