"""`tmax run "task"`: the agent in a sandbox, with a person watching (or `--json` for scripts).

The CLI only renders and asks; the loop itself is `agents.loop.Agent`, the same one that
`tmax bench` and `tmax learn` drive. Approval, Ctrl-C and follow-ups go through `AgentHooks`.
"""

from __future__ import annotations

import inspect
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from tmax_cli.config import DEFAULT_IMAGE, ConfigError, RunSettings, default_run_dir, resolve_run_settings
from tmax_cli.run_setup import discover_model, keep_long_output, load_saved, saved_workdir, sandbox_spec

# Exit status by outcome, so scripts can branch on it (documented in --help).
EXIT_CODES = {
    "submitted": 0,
    "max_steps": 3,
    "context_overflow": 4,
    "format_errors": 5,
    "model_error": 6,
    "sandbox_error": 7,
    "interrupted": 130,
}
EXIT_USAGE = 2  # bad flags, config or resume path
QUIT_WORDS = ("/q", "/quit", "/exit")

# The model must know that a resumed session has a fresh shell, or it will rely on state
# (cwd, variables, background jobs) that no longer exists.
RESUME_NOTE = (
    "[The session was resumed in a new shell: the working directory, shell variables and "
    "background jobs from before are gone; files on disk are as the sandbox left them.]"
)

_EXIT_HELP = (
    "Exit status: 0 submitted, 2 bad usage or config, 3 step limit reached, 4 context full, "
    "5 too many format errors, 6 model/server error, 7 sandbox (infrastructure) error, 130 interrupted."
)


def _fail(msg: str, json_mode: bool) -> typer.Exit:
    if json_mode:
        print(json.dumps({"type": "error", "error": msg}), flush=True)
    typer.secho(f"tmax run: {msg}", err=True, fg="red")
    return typer.Exit(EXIT_USAGE)


def _write_json_atomic(path: Path, data: Any) -> None:
    from agents.records import write_json_atomic

    write_json_atomic(path, data)


def _usage_dict(u: Any) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "reasoning_tokens": u.reasoning_tokens,
    }


def _make_hooks_classes():
    # Defined lazily so `tmax --help` does not import the agent stack.
    from agents.loop import AgentHooks

    class JsonHooks(AgentHooks):
        """Headless: one JSON object per line on stdout, no questions, Ctrl-C stops."""

        def __init__(self, session_usage: Callable[[], Any]) -> None:
            self.session_usage = session_usage  # the agent's running totals (resets per run())
            self.run_dir: Path | None = None  # where long outputs are kept
            self.output_limit = 10_000

        def emit(self, type_: str, **fields: Any) -> None:
            sys.stdout.write(json.dumps({"type": type_, **fields}, default=str) + "\n")
            sys.stdout.flush()

        def on_step_start(self, step: int) -> None:
            self.emit("step", step=step)

        def on_model_turn(self, step: int, turn: Any, command: str | None) -> None:
            self.emit(
                "model",
                step=step,
                content=turn.message.get("content"),
                command=command,
                finish_reason=turn.finish_reason,
                latency_s=round(turn.latency_s, 3),
                usage=_usage_dict(turn.usage),
                cumulative=_usage_dict(self.session_usage()),
            )

        def approve(self, step: int, command: str) -> str | None:
            self.emit("command", step=step, command=command)
            return None

        def on_observation(self, step: int, result: Any, observation: str) -> None:
            kept = keep_long_output(self.run_dir, step, result, self.output_limit)
            self.emit(
                "observation",
                step=step,
                exit_code=result.exit_code,
                timed_out=result.timed_out,
                duration_s=round(result.duration_s, 3),
                note=result.note,
                observation=observation,
                output_file=str(kept) if kept else None,
            )

        def on_format_error(self, step: int, feedback: str, reason: str | None = None) -> None:
            self.emit("format_error", step=step, feedback=feedback, reason=reason)

        def on_retry(self, attempt: int, error: Exception, delay_s: float) -> None:
            self.emit("retry", attempt=attempt, error=str(error), delay_s=delay_s)

        def on_interrupt(self) -> str | None:
            return None

    class InteractiveHooks(AgentHooks):
        """Rich rendering; approval, guidance and mode switches through the prompter."""

        def __init__(
            self, display: Any, prompter: Any, mode: str, max_steps: int | None, session_usage: Callable[[], Any]
        ) -> None:
            self.display = display
            self.prompter = prompter
            self.mode = mode
            self.max_steps = max_steps
            self.session_usage = session_usage
            self.stopping = False  # set by SIGTERM/SIGHUP or a quit at the approval prompt
            self.undo: Any = None  # tmax_cli.run_undo.UndoControl with --undo-steps
            self.undo_note: str | None = None  # what the model is told after an /undo
            self.rate: Callable[[str], str] | None = None  # /good, /bad (tmax_cli.run_training.rate)
            self.run_dir: Path | None = None  # where long outputs are kept
            self.output_limit = 10_000

        # `/y` and `/c` work at every prompt; returns True when the input was a mode command.
        def _mode_command(self, text: str) -> bool:
            cmd = text.strip().lower()
            if cmd == "/y":
                self.mode = "yolo"
                self.display.info("Mode: yolo (commands run without asking). /c to confirm again.")
                return True
            if cmd == "/c":
                self.mode = "confirm"
                self.display.info("Mode: confirm (each command waits for Enter). /y to stop asking.")
                return True
            if cmd in ("/h", "/help", "/?"):
                self.display.info(self._help())
                return True
            if cmd.split()[:1] == ["/undo"]:
                self._undo(cmd)
                return True
            if cmd in ("/good", "/bad") and self.rate is not None:
                self.display.info(self.rate(cmd))
                return True
            if cmd.startswith("/") and " " not in cmd and cmd not in QUIT_WORDS:
                # A lone `/word` is a mistyped command, not feedback meant for the model.
                self.display.warn(f"Unknown command {cmd}. {self._help()}")
                return True
            return False

        def _undo(self, cmd: str) -> None:
            if self.undo is None:
                self.display.warn("Undo is off: start tmax run with --undo-steps N to undo the last N commands.")
                return
            try:
                note = self.undo.undo(cmd)
            except ValueError as e:
                self.display.warn(str(e))
                return
            self.undo_note = f"{self.undo_note}\n{note}" if self.undo_note else note
            self.display.info(note)

        def _help(self) -> str:
            from tmax_cli.ui import HELP

            return f"{HELP}\nMode now: {self.mode}."

        def on_step_start(self, step: int) -> None:
            self.display.stop_spinner()
            self.display.step_header(step, self.max_steps)
            self.display.start_spinner("Waiting for the model… (Ctrl-C to interrupt)")

        def on_model_turn(self, step: int, turn: Any, command: str | None) -> None:
            self.display.stop_spinner()
            self.display.thought(turn.message.get("content"))
            if command is not None:
                self.display.command(command)
            self.display.usage(turn.usage, self.session_usage(), turn.latency_s)

        def approve(self, step: int, command: str) -> str | None:
            while self.mode == "confirm":
                try:
                    answer = self.prompter.ask("Enter: run · text: reject with feedback · /y yolo · /h help > ")
                except EOFError:
                    self.stopping = True
                    raise KeyboardInterrupt from None
                except KeyboardInterrupt:
                    guidance = self.on_interrupt()
                    if guidance is None:
                        self.stopping = True
                        raise
                    return guidance
                if self._mode_command(answer):
                    if self.undo_note:  # the proposed command was made for the files as they were
                        answer, self.undo_note = self.undo_note, None
                        return answer
                    continue
                if answer.strip() == "":
                    break
                if answer.strip() in QUIT_WORDS:
                    self.stopping = True
                    raise KeyboardInterrupt
                self.display.feedback(answer, "rejected; sent to the model")
                return answer
            if self.undo is not None:
                self.undo.before(command)
            self.display.start_spinner("Running… (Ctrl-C to interrupt)")
            return None

        def on_observation(self, step: int, result: Any, observation: str) -> None:
            self.display.stop_spinner()
            kept = keep_long_output(self.run_dir, step, result, self.output_limit)
            self.display.output(result.output, result.exit_code, result.duration_s, result.timed_out, result.note,
                                kept=str(kept) if kept else None)

        def on_format_error(self, step: int, feedback: str, reason: str | None = None) -> None:
            self.display.stop_spinner()
            self.display.format_error(feedback if reason is None else f"{feedback}\n\n(why: {reason})")

        def on_retry(self, attempt: int, error: Exception, delay_s: float) -> None:
            self.display.stop_spinner()
            self.display.warn(f"Model call failed ({error}); retry {attempt} in {delay_s:g}s.")
            self.display.start_spinner("Waiting for the model… (Ctrl-C to interrupt)")

        def on_interrupt(self) -> str | None:
            self.display.stop_spinner()
            if self.stopping:
                return None
            self.display.warn("Interrupted. The shell is still there.")
            while True:
                try:
                    answer = self.prompter.ask("Guidance for the agent (Enter or /q to quit) > ")
                except (EOFError, KeyboardInterrupt):
                    self.stopping = True
                    return None
                if self._mode_command(answer):
                    if self.undo_note:
                        answer, self.undo_note = self.undo_note, None
                        return answer
                    continue
                if answer.strip() in ("", *QUIT_WORDS):
                    self.stopping = True
                    return None
                return answer

        def ask_follow_up(self) -> str | None:
            while True:
                try:
                    answer = self.prompter.ask("Follow-up task in the same shell (Enter to quit) > ")
                except (EOFError, KeyboardInterrupt):
                    return None
                if self._mode_command(answer):
                    continue
                if answer.strip() in ("", *QUIT_WORDS):
                    return None
                if self.undo_note:
                    answer, self.undo_note = f"{self.undo_note}\n\n{answer}", None
                return answer

    return JsonHooks, InteractiveHooks


# --------------------------------------------------------------------------- command
def run(
    task: Optional[str] = typer.Argument(None, help="What the agent should do. Asked for when omitted (not with --json)."),
    sandbox: Optional[str] = typer.Option(
        None, "--sandbox", "-s", help="local | bwrap | podman. Default: bwrap where it works, else local."
    ),
    image: Optional[str] = typer.Option(None, "--image", help=f"Podman image. Default: {DEFAULT_IMAGE}."),
    workdir: Optional[Path] = typer.Option(
        None, "--workdir", "-w", help="Starting directory (host path for local/bwrap, container path for podman)."
    ),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model name. Default: $TMAX_MODEL, config file, or the server's only model."),
    base_url: Optional[str] = typer.Option(
        None, "--base-url", help="OpenAI-compatible API URL. Default: $TMAX_BASE_URL, $OPENAI_BASE_URL, then the config file."
    ),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Default: $TMAX_API_KEY, $OPENAI_API_KEY, then the config file."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Model turns per task (default 64)."),
    mode: Optional[str] = typer.Option(
        None, "--mode", help="confirm (ask before each command) | yolo. Default: confirm for local, yolo for bwrap/podman."
    ),
    json_mode: bool = typer.Option(False, "--json", help="Headless: one JSON event per line on stdout, no prompts."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the conversation saved in this run directory."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Trajectory directory. Default: $XDG_DATA_HOME/tmax/runs/<timestamp>."
    ),
    network: bool = typer.Option(False, "--network/--no-network", help="Network access inside bwrap/podman (off by default)."),
    harness: str = typer.Option("tmax", "--harness", help="Agent style: tmax (Vanillux2) | mini-swe | terminus-2."),
    undo_steps: int = typer.Option(
        0, "--undo-steps", min=0, help="Snapshot the files before each command so /undo [K] can restore them (last N kept; 0: off)."
    ),
    budget_hints: bool = typer.Option(False, "--budget-hints", help="Append the steps, time and context left to each observation."),
    tokens: bool = typer.Option(
        False, "--tokens", help="Sample token ids from a vLLM server (tmax serve) and record tokens.json for `tmax learn --from-runs`."
    ),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="With --tokens: the model's tokenizer directory (default: the served model's)."),
    verify: Optional[str] = typer.Option(None, "--verify", help="Command run in the sandbox at the end; exit status 0 stores reward 1, else 0."),
    command_timeout: Optional[float] = typer.Option(
        None, "--command-timeout", help="Seconds a command may run before it is stopped (default 120; $TMAX_COMMAND_TIMEOUT)."
    ),
    model_timeout: Optional[float] = typer.Option(
        None, "--model-timeout", help="Seconds one model request may take before it is retried (default 600; $TMAX_MODEL_TIMEOUT)."
    ),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", help="Most tokens per model turn (default 16384, lowered to what the server's context window leaves)."
    ),
    expose: list[str] = typer.Option(
        [], "--expose", help="A credential path the bwrap jail masks by default (~/.ssh, ~/.aws, ...) to show inside; repeatable."
    ),
) -> None:
    """Run the agent on a task in a persistent shell.

    In confirm mode press Enter to run a command, or type why not (sent to the model); /y switches to yolo, /c back to confirm. Ctrl-C interrupts the model or the command and asks for guidance.

    Settings come from flags, then environment, then $XDG_CONFIG_HOME/tmax/config.toml (~/.config/tmax/config.toml).
    """
    try:
        if json_mode and not task:
            raise ConfigError("--json needs the task (or, with --resume, the follow-up) as an argument")
        if json_mode and undo_steps:
            raise ConfigError("--undo-steps needs the interactive UI (/undo), not --json")
        settings = resolve_run_settings(
            base_url=base_url, model=model, api_key=api_key, sandbox=sandbox, mode=mode, image=image, max_steps=max_steps,
            max_tokens=max_tokens, command_timeout=command_timeout, model_timeout=model_timeout, expose=expose,
        )
        from agents.harnesses import check_harness

        check_harness(harness, "--harness")
        saved = load_saved(resume) if resume is not None else None
        if resume is not None and workdir is None:
            workdir = saved_workdir(resume, settings.sandbox)
        spec = sandbox_spec(settings, workdir, network)
        if settings.model is None:
            settings.model = discover_model(settings.base_url, settings.api_key)
            settings.sources["model"] = f"{settings.base_url}/models"
        token_setup = None
        if tokens:
            from tmax_cli.run_training import prepare_tokens

            token_setup = prepare_tokens(settings.base_url, settings.model, settings.api_key, tokenizer)
    except (ConfigError, ValueError) as e:
        raise _fail(str(e), json_mode) from None
    raise typer.Exit(_run(settings, spec, task, json_mode, saved, resume, output, harness=harness, undo_steps=undo_steps,
                          budget_hints=budget_hints, token_setup=token_setup, verify=verify))


def _run(settings: RunSettings, spec: Any, task: str | None, json_mode: bool, saved: Any, resume: Path | None, output: Path | None,
         *, harness: str = "tmax", undo_steps: int = 0, budget_hints: bool = False, token_setup: Any = None,
         verify: str | None = None) -> int:
    from rich.console import Console

    from agents.chat_policy import ChatPolicy
    from agents.harnesses import make_harness
    from agents.loop import Agent, AgentConfig
    from agents.records import Recorder
    from sandbox import make_sandbox
    from sandbox.base import SandboxError
    from tmax_cli.config import data_dir
    from tmax_cli.ui import Display, Prompter

    JsonHooks, InteractiveHooks = _make_hooks_classes()
    # In --json mode stdout carries only events; human-readable notes go to stderr.
    display = Display(Console(stderr=True, highlight=False) if json_mode else Console(highlight=False))
    agent = None

    def session_usage():
        from agents.policy import Usage

        return agent.usage if agent is not None else Usage()

    if json_mode:
        hooks = JsonHooks(session_usage)
    else:
        prompter = Prompter(data_dir() / "history")
        hooks = InteractiveHooks(display, prompter, settings.mode, settings.max_steps, session_usage)
        if not task:
            try:
                task = prompter.ask("Follow-up for the resumed session > " if saved else "Task > ").strip()
            except (EOFError, KeyboardInterrupt):
                task = ""
            if not task:
                display.error("No task given.")
                return EXIT_USAGE
    assert task

    run_dir = (output or default_run_dir()).expanduser().resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        display.error(f"cannot create the trajectory directory {run_dir}: {e}")
        return EXIT_USAGE
    # The CLI's own record of the session (result.json, written by the agent, has the outcome per episode).
    meta = {
        "task": task,
        "model": settings.model,
        "harness": harness,
        "base_url": settings.base_url,
        "sandbox": settings.sandbox,
        "mode": settings.mode,
        "workdir": spec.workdir,
        "resumed_from": str(resume.resolve()) if resume else None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "running",
    }
    _write_json_atomic(run_dir / "run.json", meta)

    config = AgentConfig.from_settings({"command_timeout": settings.command_timeout, "max_steps": settings.max_steps,
                                        "max_tokens": settings.max_tokens, "budget_hints": budget_hints})
    hooks.run_dir, hooks.output_limit = run_dir, config.observation_max_chars
    policy = token_setup.policy(config) if token_setup is not None else ChatPolicy(
        model=settings.model,
        base_url=settings.base_url,
        api_key=settings.api_key,
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens,
        timeout=settings.model_timeout,
    )
    if token_setup is not None:
        meta["model_dir"] = str(token_setup.model_dir)  # what `tmax learn sft --from-runs` starts from
        _write_json_atomic(run_dir / "run.json", meta)
    box = None
    agent_harness = make_harness(harness, spec.workdir)

    # SIGTERM / SIGHUP end the run like a Ctrl-C answered with "quit", so the sandbox is
    # removed; a running command's process group is killed at once.
    def _terminate(signum, frame):
        if isinstance(hooks, InteractiveHooks):
            hooks.stopping = True
        if box is not None:
            agent_harness.interrupt(box, force=True)
        raise KeyboardInterrupt

    old_handlers = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Started in the background by a script, this process inherits SIGINT ignored: Ctrl-C
    # (kill -INT) must still stop a command and the run.
    old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    if json_mode:
        hooks.emit("start", run_id=run_dir.name, model=settings.model, base_url=settings.base_url,
                   sandbox=settings.sandbox, workdir=spec.workdir, mode=settings.mode, trajectory_dir=str(run_dir))
    else:
        display.info(
            f"tmax · model {settings.model} at {settings.base_url} · sandbox {settings.sandbox} · "
            f"mode {settings.mode} · trajectory {run_dir}"
        )
        if settings.mode == "confirm":
            display.info("Enter runs a command, text rejects it with feedback, /y: yolo, /c: confirm, Ctrl-C: interrupt.")

    result = None
    status, error = "sandbox_error", None
    try:
        if not json_mode:
            display.start_spinner(f"Starting the {settings.sandbox} sandbox…")
        try:
            box = make_sandbox(settings.sandbox, spec)
            box.start()
        except SandboxError:
            raise
        except Exception as e:  # e.g. a missing binary: still the infrastructure, not the agent
            raise SandboxError(f"could not start the {settings.sandbox} sandbox: {e}") from e
        display.stop_spinner()
        if undo_steps:
            from tmax_cli.run_undo import UndoControl

            hooks.undo = UndoControl(box, undo_steps)
        if not json_mode:
            from tmax_cli.run_training import rate

            hooks.rate = lambda word: rate(run_dir, word)
        agent = Agent(policy, box, config=config, recorder=Recorder(run_dir), hooks=hooks,
                      harness=agent_harness)
        if saved is not None:
            display.warn(
                f"Resumed {len(saved.messages)} messages from {resume.resolve()}. This is a new shell: the working directory, "
                "variables and background jobs of the earlier session are not restored (files are, where the "
                "sandbox kept them)."
            )
            agent.load(saved)
            if not json_mode:
                display.task(task, title="follow-up")
            result = agent.follow_up(f"{RESUME_NOTE}\n\n{task}")
        else:
            if not json_mode:
                display.task(task)
            result = agent.run(task)
        while not json_mode and result.status in ("submitted", "max_steps", "format_errors"):
            display.info(f"{result.status} after {result.steps} steps.")
            follow = hooks.ask_follow_up()
            if follow is None:
                break
            display.task(follow, title="follow-up")
            result = agent.follow_up(follow)
        status, error = result.status, result.error
        if verify:
            from tmax_cli.run_training import verify as run_verify

            rated = run_verify(box, verify, run_dir)
            if json_mode:
                hooks.emit("reward", reward=rated["reward"], exit_code=rated["exit_code"], command=verify)
            else:
                display.info(f"--verify exited {rated['exit_code']}: reward {rated['reward']:g} (in {run_dir / 'reward.json'}).")
    except SandboxError as e:
        status, error = "sandbox_error", f"sandbox failure (infrastructure, not the agent): {e}"
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
    finally:
        display.stop_spinner()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if getattr(hooks, "undo", None) is not None:
            hooks.undo.close()
        if box is not None:
            try:
                if agent is not None:
                    agent.harness.close()
                box.close()
            except Exception as e:  # cleanup must not hide the outcome
                display.warn(f"closing the sandbox failed: {e}")
    steps = agent.steps if agent is not None else 0
    meta.update(status=status, error=error, steps=steps, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _write_json_atomic(run_dir / "run.json", meta)

    code = EXIT_CODES.get(status, 1)
    if json_mode:
        hooks.emit(
            "done",
            status=status,
            exit_code=code,
            steps=steps,
            usage=_usage_dict(session_usage()),
            error=error,
            trajectory_dir=str(run_dir),
        )
    else:
        if error and status != "interrupted":
            display.error(error)
        display.info(_summary(status, steps, run_dir))
    return code


def _summary(status: str, steps: int, run_dir: Path) -> str:
    return f"{status} after {steps} steps · trajectory: {run_dir} (view it with `tmax show {run_dir}`)"


def register(app: typer.Typer) -> None:
    app.command("run", help=f"{inspect.cleandoc(run.__doc__ or '')}\n\n{_EXIT_HELP}")(run)
