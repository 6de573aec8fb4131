"""The body of `tmax run` once its flags are checked: ask for the task, keep the run's record
(`run.json`, final on every exit), open the session (`agents.session`), drive the agent
through the task and its follow-ups, verify, and report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tmax.cli.config import RunSettings, data_dir, default_run_dir
from tmax.cli.run_hooks import InteractiveHooks, JsonHooks, usage_dict
from tmax.cli.run_setup import EXIT_CODES, EXIT_USAGE, RESUME_NOTE


@dataclass
class RunRequest:
    """Everything `tmax run` was asked to do, checked."""

    settings: RunSettings
    spec: Any  # sandbox.base.SandboxSpec
    task: str | None
    json_mode: bool
    saved: Any  # agents.records.SavedRun to continue, or None
    resume: Path | None
    output: Path | None
    harness: str = "tmax"
    undo_steps: int = 0
    budget_hints: bool = False
    token_setup: Any = None  # tmax.cli.run_training.TokenSetup with --tokens
    verify: str | None = None


@dataclass
class RunRecord:
    """`run.json`: the CLI's own record of the session (result.json, written by the agent,
    has the outcome per episode). "running" until `finish`, which every exit reaches."""

    run_dir: Path
    meta: dict[str, Any] = field(default_factory=dict)

    def write(self, **fields: Any) -> None:
        from tmax.common.files import write_json_atomic

        self.meta.update(fields)
        write_json_atomic(self.run_dir / "run.json", self.meta)

    def finish(self, status: str, error: str | None, steps: int) -> None:
        self.write(status=status, error=error, steps=steps, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def _display(json_mode: bool) -> Any:
    from rich.console import Console

    from tmax.cli.ui import Display

    # In --json mode stdout carries only events; human-readable notes go to stderr.
    return Display(Console(stderr=True, highlight=False) if json_mode else Console(highlight=False))


def _hooks(run: RunRequest, display: Any, session_usage: Any) -> Any:
    if run.json_mode:
        return JsonHooks(session_usage)
    from tmax.cli.ui import Prompter

    return InteractiveHooks(display, Prompter(data_dir() / "history"), run.settings.mode, run.settings.max_steps,
                            session_usage)


def _ask_task(run: RunRequest, hooks: Any) -> str:
    if run.task or run.json_mode:
        return run.task or ""
    try:
        return hooks.prompter.ask("Follow-up for the resumed session > " if run.saved else "Task > ").strip()
    except (EOFError, KeyboardInterrupt):
        return ""


def _agent_config(run: RunRequest) -> Any:
    from tmax.agents.loop import AgentConfig

    s = run.settings
    return AgentConfig.from_settings({"command_timeout": s.command_timeout, "max_steps": s.max_steps,
                                      "max_tokens": s.max_tokens, "budget_hints": run.budget_hints})


def _policy(run: RunRequest, config: Any) -> Any:
    if run.token_setup is not None:
        return run.token_setup.policy(config)
    from tmax.agents.chat_policy import ChatPolicy

    s = run.settings
    return ChatPolicy(model=s.model, base_url=s.base_url, api_key=s.api_key, temperature=config.temperature,
                      top_p=config.top_p, max_tokens=config.max_tokens, timeout=s.model_timeout)


def drive(run: RunRequest) -> int:
    """Run the session; returns the process exit status."""
    agent_box: dict[str, Any] = {}  # the Agent, once made: its usage is the session's

    def session_usage() -> Any:
        from tmax.agents.policy import Usage

        return agent_box["agent"].usage if "agent" in agent_box else Usage()

    display = _display(run.json_mode)
    hooks = _hooks(run, display, session_usage)
    task = _ask_task(run, hooks)
    if not task:
        display.error("No task given.")
        return EXIT_USAGE
    run_dir = (run.output or default_run_dir()).expanduser().resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        display.error(f"cannot create the trajectory directory {run_dir}: {e}")
        return EXIT_USAGE
    s = run.settings
    record = RunRecord(run_dir, {
        "task": task, "model": s.model, "harness": run.harness, "base_url": s.base_url, "sandbox": s.sandbox,
        "mode": s.mode, "workdir": run.spec.workdir, "resumed_from": str(run.resume.resolve()) if run.resume else None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "status": "running",
    })
    record.write()
    status, error, steps = _session(run, task, run_dir, record, hooks, display, agent_box)
    record.finish(status, error, steps)
    code = EXIT_CODES.get(status, 1)
    if run.json_mode:
        hooks.emit("done", status=status, exit_code=code, steps=steps, usage=usage_dict(session_usage()), error=error,
                   trajectory_dir=str(run_dir))
    else:
        if error and status != "interrupted":
            display.error(error)
        display.info(f"{status} after {steps} steps · trajectory: {run_dir} (view it with `tmax show {run_dir}`)")
    return code


def _announce(run: RunRequest, hooks: Any, display: Any, run_dir: Path) -> None:
    s = run.settings
    if run.json_mode:
        hooks.emit("start", run_id=run_dir.name, model=s.model, base_url=s.base_url, sandbox=s.sandbox,
                   workdir=run.spec.workdir, mode=s.mode, trajectory_dir=str(run_dir))
        return
    display.info(f"tmax · model {s.model} at {s.base_url} · sandbox {s.sandbox} · mode {s.mode} · trajectory {run_dir}")
    if s.mode == "confirm":
        display.info("Enter runs a command, text rejects it with feedback, /y: yolo, /c: confirm, Ctrl-C: interrupt.")


def _session(run: RunRequest, task: str, run_dir: Path, record: RunRecord, hooks: Any, display: Any,
             agent_box: dict[str, Any]) -> tuple[str, str | None, int]:
    """Open the sandbox, drive the agent; (status, error, steps) whatever happens."""
    from tmax.agents.harnesses import make_harness
    from tmax.agents.session import RunSession
    from tmax.sandbox.base import SandboxError

    status, error = "sandbox_error", None
    try:
        config = _agent_config(run)
        hooks.run_dir, hooks.output_limit = run_dir, config.observation_max_chars
        policy = _policy(run, config)
        if run.token_setup is not None:
            record.write(model_dir=str(run.token_setup.model_dir))  # what `tmax learn sft --from-runs` starts from
        if run.settings.sandbox == "bwrap":
            run.spec.masked.append(str(run_dir))  # the run's own records, wherever -o put them
        harness = make_harness(run.harness, run.spec.workdir)
        with RunSession(run.settings.sandbox, run.spec, harness, on_terminate=lambda: _stop(hooks)) as session:
            _announce(run, hooks, display, run_dir)
            try:
                status, error = _converse(run, task, run_dir, session, config, policy, hooks, display, agent_box)
            finally:
                display.stop_spinner()
                if getattr(hooks, "undo", None) is not None:
                    hooks.undo.close()
        if session.close_error:
            display.warn(session.close_error)
    except SandboxError as e:
        status, error = "sandbox_error", f"sandbox failure (infrastructure, not the agent): {e}"
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
    except Exception as e:  # a defect, not the agent's or the sandbox's doing: still a final record
        import traceback

        traceback.print_exc()
        status, error = "internal_error", f"tmax failed: {type(e).__name__}: {e}"
    finally:
        display.stop_spinner()
    return status, error, (agent_box["agent"].steps if "agent" in agent_box else 0)


def _stop(hooks: Any) -> None:
    if isinstance(hooks, InteractiveHooks):
        hooks.stopping = True


def _converse(run: RunRequest, task: str, run_dir: Path, session: Any, config: Any, policy: Any, hooks: Any,
              display: Any, agent_box: dict[str, Any]) -> tuple[str, str | None]:
    """The task (or the resumed session's follow-up), then follow-ups until the user stops."""
    from tmax.agents.loop import Agent
    from tmax.agents.records import Recorder

    if not run.json_mode:
        display.start_spinner(f"Starting the {run.settings.sandbox} sandbox…")
    box = session.start()
    display.stop_spinner()
    box.watch_output(hooks.on_command_output)  # what the model gets is the same; this is for the screen
    if run.undo_steps:
        from tmax.cli.run_undo import UndoControl

        if not run.json_mode:
            display.start_spinner("Preparing undo: one copy of the workspace (instant where the filesystem clones)…")
        hooks.undo = UndoControl(box, run.undo_steps)
        display.stop_spinner()
    if not run.json_mode:
        from tmax.agents.rating import rate

        hooks.rate = lambda word: rate(run_dir, word)
    agent = agent_box["agent"] = Agent(policy, box, config=config, recorder=Recorder(run_dir), hooks=hooks,
                                       harness=session.harness)
    if run.saved is not None:
        display.warn(
            f"Resumed {len(run.saved.messages)} messages from {run.resume.resolve()}. This is a new shell: the working "
            "directory, variables and background jobs of the earlier session are not restored (files are, where the "
            "sandbox kept them).")
        agent.load(run.saved)
        if not run.json_mode:
            display.task(task, title="follow-up")
        result = agent.follow_up(f"{RESUME_NOTE}\n\n{task}")
    else:
        if not run.json_mode:
            display.task(task)
        result = agent.run(task)
    while not run.json_mode and result.status in ("submitted", "max_steps", "format_errors"):
        display.info(f"{result.status} after {result.steps} steps.")
        follow = hooks.ask_follow_up()
        if follow is None:
            break
        display.task(follow, title="follow-up")
        result = agent.follow_up(follow)
    if run.verify:
        _verify(run, box, run_dir, hooks, display)
    return result.status, result.error


def _verify(run: RunRequest, box: Any, run_dir: Path, hooks: Any, display: Any) -> None:
    from tmax.agents.rating import verify

    rated = verify(box, run.verify, run_dir)
    if run.json_mode:
        hooks.emit("reward", reward=rated["reward"], exit_code=rated["exit_code"], command=run.verify)
    else:
        display.info(f"--verify exited {rated['exit_code']}: reward {rated['reward']:g} (in {run_dir / 'reward.json'}).")
