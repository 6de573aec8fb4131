"""The body of `tmax run` once its flags are checked: ask for the task, keep the run's record
(`run.json`, final on every exit), open the session (`cli.run_session`), drive the agent
through the task and its follow-ups, verify, and report."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tmax.cli.run_settings import RunSettings, data_dir, default_run_dir
from tmax.cli.run_hooks import InteractiveHooks, JsonHooks, emit, usage_dict
from tmax.cli.run_setup import EXIT_CODES, EXIT_USAGE, RESUME_NOTE
from tmax.common.records import AgentStatus, InstructionSource, RunRecord, SessionDir, now_stamp, write_record

if TYPE_CHECKING:
    from tmax.agents.compaction import CompactionRecord, ContextUse
    from tmax.agents.driver import EpisodeDriver, EpisodeResult
    from tmax.agents.instructions import Instructions
    from tmax.agents.policy import Policy, Usage
    from tmax.agents.recorder import SavedRun
    from tmax.cli.run_session import RunSession
    from tmax.agents.agent_settings import AgentSettings
    from tmax.cli.run_tokens import TokenSetup
    from tmax.cli.run_undo import UndoControl
    from tmax.cli.ui import Display, Prompter
    from tmax.sandbox.base import Sandbox, SandboxSpec

if TYPE_CHECKING:
    from tmax.sandbox.base import SandboxSpec


@dataclass
class RunRequest:
    """Everything `tmax run` was asked to do, checked."""

    settings: RunSettings
    spec: SandboxSpec
    task: str | None
    json_mode: bool
    saved: SavedRun | None  # the session to continue
    resume: Path | None
    output: Path | None
    harness: str = "tmax"
    undo_steps: int = 0
    token_setup: TokenSetup | None = None  # with --tokens
    verify: str | None = None
    instructions: Instructions | None = None  # for the system prompt


@dataclass
class RunFile:
    """`run.json` (`common.records.RunRecord`): the CLI's own record of the session (the
    agent's outcome.json has the outcome per episode). "running" until `finish`, which every
    exit reaches."""

    run_dir: Path
    record: RunRecord

    def write(self, **fields: object) -> None:
        self.record = self.record.model_copy(update=fields)
        write_record(SessionDir(self.run_dir).run, self.record)

    def finish(self, status: AgentStatus, error: str | None, steps: int) -> None:
        self.write(status=AgentStatus(status), error=error, steps=steps, finished_at=now_stamp())


def _display(json_mode: bool) -> Display:
    from rich.console import Console

    from tmax.cli.ui import Display

    # In --json mode stdout carries only events; human-readable notes go to stderr.
    return Display(Console(stderr=True, highlight=False) if json_mode else Console(highlight=False))


@dataclass
class _Talk:
    """What the run talks through: the screen, the line reader (None with --json), the stop
    flag SIGTERM and quits set, and the episode driver once the sandbox is up."""

    display: Display
    prompter: Prompter | None
    stopping: threading.Event = field(default_factory=threading.Event)
    driver: EpisodeDriver | None = None

    def usage(self) -> Usage:
        from tmax.agents.policy import Usage

        return self.driver.usage if self.driver is not None else Usage()

    def context(self) -> ContextUse | None:
        """How full the context window is (`agents.compaction.ContextUse`), once the driver is up."""
        return self.driver.context_use if self.driver is not None else None

    def compact(self, focus: str | None) -> CompactionRecord | None:
        return self.driver.compact(focus) if self.driver is not None else None

    @property
    def steps(self) -> int:
        return self.driver.steps if self.driver is not None else 0


def _hooks(run: RunRequest, talk: _Talk, run_dir: Path, config: AgentSettings,
           undo: UndoControl | None) -> JsonHooks | InteractiveHooks:
    if run.json_mode:
        return JsonHooks(talk.usage, run_dir, config.observation_max_chars, context=talk.context)
    from tmax.agents.rating import rate

    return InteractiveHooks(talk.display, talk.prompter, run.settings.mode, run.settings.agent.max_steps, talk.usage,
                            run_dir=run_dir, output_limit=config.observation_max_chars, stopping=talk.stopping,
                            undo=undo, rate=lambda word: rate(run_dir, word), context=talk.context,
                            compact=talk.compact)


def _ask_task(run: RunRequest, prompter: Prompter | None) -> str:
    if run.task or run.json_mode:
        return run.task or ""
    try:
        assert prompter is not None  # there is one unless --json
        return prompter.ask("Follow-up for the resumed session > " if run.saved else "Task > ").strip()
    except (EOFError, KeyboardInterrupt):
        return ""


def _policy(run: RunRequest, config: AgentSettings) -> Policy:
    if run.token_setup is not None:
        return run.token_setup.policy(config)
    from tmax.agents.chat_policy import ChatPolicy

    s = run.settings
    return ChatPolicy(model=s.model, base_url=s.base_url, api_key=s.api_key, temperature=config.temperature,
                      top_p=config.top_p, max_tokens=config.max_tokens, timeout=s.model_timeout, prices=s.prices)


def drive(run: RunRequest) -> int:
    """Run the session; returns the process exit status."""
    display = _display(run.json_mode)
    prompter = None
    if not run.json_mode:
        from tmax.cli.ui import Prompter

        prompter = Prompter(data_dir() / "history")
    talk = _Talk(display, prompter)
    task = _ask_task(run, prompter)
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
    record = RunFile(run_dir, RunRecord(
        task=task, model=s.model, harness=run.harness, base_url=s.base_url, sandbox=s.sandbox, mode=s.mode,
        workdir=run.spec.workdir, resumed_from=str(run.resume.resolve()) if run.resume else None,
        started_at=now_stamp(), status=AgentStatus.RUNNING,
        instructions=[InstructionSource(**vars(src)) for src in run.instructions.sources] if run.instructions else [],
    ))
    record.write()
    if run.instructions is not None:  # what was added to the system prompt (trajectory.json holds it too)
        from tmax.common.files import write_text_atomic

        write_text_atomic(SessionDir(run_dir).instructions, run.instructions.text)
    status, error = _session(run, task, run_dir, record, talk)
    record.finish(status, error, talk.steps)
    code = EXIT_CODES.get(status, 1)
    if run.json_mode:
        emit("done", status=status, exit_code=code, steps=talk.steps, usage=usage_dict(talk.usage()), error=error,
             trajectory_dir=str(run_dir))
    else:
        if error and status != "interrupted":
            display.error(error)
        display.info(f"{status} after {talk.steps} steps · trajectory: {run_dir} (view it with `tmax show {run_dir}`)")
    return code


def _announce(run: RunRequest, display: Display, run_dir: Path) -> None:
    s = run.settings
    threshold = s.agent.compaction_threshold if s.agent.compaction else None
    if run.json_mode:
        emit("start", run_id=run_dir.name, model=s.model, base_url=s.base_url, sandbox=s.sandbox,
             workdir=run.spec.workdir, mode=s.mode, trajectory_dir=str(run_dir), compaction_threshold=threshold,
             instructions=[src.path for src in run.instructions.sources] if run.instructions else [])
        return
    display.info(f"tmax · model {s.model} at {s.base_url} · sandbox {s.sandbox} · mode {s.mode} · trajectory {run_dir}")
    if run.instructions is not None:
        display.info(run.instructions.describe())
    when = f"compaction at {threshold:.0%} of the context window" if threshold else "compaction off (--no-compact)"
    display.note(f"{when}; /compact [focus] compacts now, /usage shows the tokens used")
    if s.mode == "confirm":
        display.info("Enter runs a command, text rejects it with feedback, /y: yolo, /c: confirm, Ctrl-C: interrupt.")


def _session(run: RunRequest, task: str, run_dir: Path, record: RunFile,
             talk: _Talk) -> tuple[AgentStatus, str | None]:
    """Open the sandbox, drive the agent; (status, error) whatever happens."""
    from tmax.agents.harnesses import make_harness
    from tmax.cli.run_session import RunSession
    from tmax.sandbox.base import SandboxError

    status, error = AgentStatus.SANDBOX_ERROR, None
    display = talk.display
    try:
        config = run.settings.agent
        policy = _policy(run, config)
        if run.token_setup is not None:
            record.write(model_dir=str(run.token_setup.model_dir))  # what `tmax learn sft --from-runs` starts from
        if run.settings.sandbox == "bwrap":
            run.spec.masked.append(str(run_dir))  # the run's own records, wherever -o put them
        harness = make_harness(run.harness, run.spec.workdir)
        with RunSession(run.settings.sandbox, run.spec, harness, on_terminate=talk.stopping.set) as session:
            _announce(run, display, run_dir)
            try:
                status, error = _converse(run, task, run_dir, session, config, policy, talk)
            finally:
                display.stop_spinner()
        if session.close_error:
            display.warn(session.close_error)
    except SandboxError as e:
        status, error = AgentStatus.SANDBOX_ERROR, f"sandbox failure (infrastructure, not the agent): {e}"
    except KeyboardInterrupt:
        status, error = AgentStatus.INTERRUPTED, "interrupted by the user"
    except Exception as e:  # a defect, not the agent's or the sandbox's doing: still a final record
        import traceback

        traceback.print_exc()
        status, error = AgentStatus.INTERNAL_ERROR, f"tmax failed: {type(e).__name__}: {e}"
    finally:
        display.stop_spinner()
    return status, error


def _undo(run: RunRequest, box: Sandbox, display: Display) -> UndoControl | None:
    """The undo history with --undo-steps N, else None."""
    if not run.undo_steps:
        return None
    from tmax.cli.run_undo import UndoControl

    if not run.json_mode:
        display.start_spinner("Preparing undo: one copy of the workspace (instant where the filesystem clones)…")
    try:
        return UndoControl(box, run.undo_steps)
    finally:
        display.stop_spinner()


def _converse(run: RunRequest, task: str, run_dir: Path, session: RunSession, config: AgentSettings,
              policy: Policy, talk: _Talk) -> tuple[AgentStatus, str | None]:
    """The task (or the resumed session's follow-up), then follow-ups until the user stops."""
    from tmax.agents.driver import EpisodeDriver
    from tmax.agents.recorder import Recorder

    display = talk.display
    if not run.json_mode:
        display.start_spinner(f"Starting the {run.settings.sandbox} sandbox…")
    box = session.start()
    display.stop_spinner()
    undo = _undo(run, box, display)
    try:
        hooks = _hooks(run, talk, run_dir, config, undo)
        box.watch_output(hooks.on_command_output)  # what the model gets is the same; this is for the screen
        text = run.instructions.text if run.instructions is not None else None
        with EpisodeDriver(policy, box, session.harness, config, recorder=Recorder(run_dir), hooks=hooks,
                           instructions=text) as driver:
            talk.driver = driver
            result = _first(run, task, driver, display)
            while not run.json_mode and result.status in (AgentStatus.SUBMITTED, AgentStatus.MAX_STEPS,
                                                          AgentStatus.FORMAT_ERRORS):
                display.info(f"{result.status} after {result.steps} steps.")
                follow = hooks.ask_follow_up()
                if follow is None:
                    break
                display.task(follow, title="follow-up")
                result = driver.follow_up(follow)
        if run.verify:
            _verify(run, box, run_dir, display)
    finally:
        if undo is not None:
            undo.close()
    return result.status, result.error


def _first(run: RunRequest, task: str, driver: EpisodeDriver, display: Display) -> EpisodeResult:
    """The task, or with --resume the saved conversation and the task as its follow-up."""
    if run.saved is None:
        if not run.json_mode:
            display.task(task)
        return driver.run(task)
    display.warn(
        f"Resumed {len(run.saved.messages)} messages from {run.resume.resolve()}. This is a new shell: the working "
        "directory, variables and background jobs of the earlier session are not restored (files are, where the "
        "sandbox kept them).")
    driver.load(run.saved)
    if not run.json_mode:
        display.task(task, title="follow-up")
    return driver.follow_up(f"{RESUME_NOTE}\n\n{task}")


def _verify(run: RunRequest, box: Sandbox, run_dir: Path, display: Display) -> None:
    from tmax.agents.rating import verify

    rated = verify(box, run.verify, run_dir)
    if run.json_mode:
        emit("reward", reward=rated.reward, exit_code=rated.exit_code, command=run.verify)
    else:
        display.info(f"--verify exited {rated.exit_code}: reward {rated.reward:g} (in {SessionDir(run_dir).reward}).")
