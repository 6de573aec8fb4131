"""`tmax run "task"`: the agent in a sandbox, with a person watching (or `--json` for scripts).

The CLI only renders and asks; the loop itself is `agents.loop.Agent`, driven by
`agents.driver.EpisodeDriver` as `tmax bench` and `tmax learn` drive it. Approval, Ctrl-C and
follow-ups go through `AgentHooks` (`tmax.cli.run_hooks`); the sandbox and signals of the run
are `agents.session`.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from tmax.cli.config import DEFAULT_IMAGE, ConfigError, resolve_run_settings
from tmax.cli.run_setup import (EXIT_USAGE, broad_workspace, discover_model, load_saved, project_instructions,
                                saved_workdir, sandbox_spec)

_EXIT_HELP = (
    "Exit status: 0 submitted, 2 bad usage or config, 3 step limit reached, 4 context full, "
    "5 too many format errors, 6 model/server error, 7 sandbox (infrastructure) error, 130 interrupted, "
    "1 an error in tmax itself."
)


def _fail(msg: str, json_mode: bool) -> typer.Exit:
    if json_mode:
        print(json.dumps({"type": "error", "error": msg}), flush=True)
    typer.secho(f"tmax run: {msg}", err=True, fg="red")
    return typer.Exit(EXIT_USAGE)


def _confirm_workspace(why: str | None, yes: bool, json_mode: bool) -> None:
    """Ask before a workspace that makes the jail hardly one; refuse where nobody can answer."""
    if why is None or yes:
        return
    if json_mode or not sys.stdin.isatty():
        raise ConfigError(f"{why}; pass --yes to allow it, or start from a project directory (--workdir DIR)")
    if not typer.confirm(f"{why}. Go on?", default=False):
        raise ConfigError("stopped: start from a project directory or pass --workdir DIR")


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
    yes: bool = typer.Option(False, "--yes", help="Do not ask before making your whole home directory the bwrap workspace."),
    compact: Optional[bool] = typer.Option(
        None, "--compact/--no-compact", help="Summarise the session when its context nears the window (on by default)."
    ),
    compact_threshold: Optional[float] = typer.Option(
        None, "--compact-threshold", help="The share of the context window that sets compaction off, in (0, 1) (default 0.8)."
    ),
    instructions: Optional[Path] = typer.Option(
        None, "--instructions", help="A file of project instructions for the system prompt, after the AGENTS.md files."
    ),
    no_instructions: bool = typer.Option(False, "--no-instructions", help="Do not read AGENTS.md files."),
) -> None:
    """Run the agent on a task in a persistent shell.

    In confirm mode press Enter to run a command, or type why not (sent to the model); /y switches to yolo, /c back to confirm. Ctrl-C interrupts the model or the command and asks for guidance.

    Settings come from flags, then environment, then $XDG_CONFIG_HOME/tmax/config.toml (~/.config/tmax/config.toml).
    """
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
            budget_hints=budget_hints or None, compaction=compact, compaction_threshold=compact_threshold,
        )
        from tmax.agents.harnesses import check_harness

        check_harness(harness, "--harness")
        saved = load_saved(resume) if resume is not None else None
        if resume is not None and workdir is None:
            workdir = saved_workdir(resume, settings.sandbox)
        spec = sandbox_spec(settings, workdir, network)
        project = project_instructions(instructions, no_instructions, settings.sandbox, spec.workdir, resume is not None)
        if spec.workspace is not None:
            _confirm_workspace(broad_workspace(settings.sandbox, spec.workspace), yes, json_mode)
        if settings.model is None:
            settings.model = discover_model(settings.base_url, settings.api_key)
            settings.sources["model"] = f"{settings.base_url}/models"
        token_setup = None
        if tokens:
            from tmax.cli.run_training import prepare_tokens

            token_setup = prepare_tokens(settings.base_url, settings.model, settings.api_key, tokenizer)
    except (ConfigError, ValueError) as e:
        raise _fail(str(e), json_mode) from None
    from tmax.cli.run_drive import RunRequest, drive

    raise typer.Exit(drive(RunRequest(settings, spec, task, json_mode, saved, resume, output, harness=harness,
                                      undo_steps=undo_steps, token_setup=token_setup,
                                      verify=verify, instructions=project)))


def register(app: typer.Typer) -> None:
    app.command("run", help=f"{inspect.cleandoc(run.__doc__ or '')}\n\n{_EXIT_HELP}")(run)
