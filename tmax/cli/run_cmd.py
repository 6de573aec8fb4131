"""`tmax run "task"`: the agent in a sandbox, with a person watching (or `--json` for scripts).

The CLI only renders and asks; the loop itself is `agents.loop.Agent`, driven by
`agents.driver.EpisodeDriver` as `tmax bench` and `tmax learn` drive it. Approval, Ctrl-C and
follow-ups go through `AgentHooks` (`tmax.cli.run_hooks`); the sandbox and signals of the run
are `cli.run_session`.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from tmax.cli.run_settings import ConfigError, RunKeys, resolve_run_settings
from tmax.cli.options import PRINT_CONFIG, FlagValues, note_old_spelling, option_parameter, setting_flags
from tmax.cli.options import print_config as print_config_lines
from tmax.common.settings import describe_values
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
_SHARED = [
    option_parameter("config", Optional[Path], typer.Option(
        None, "--config", "-c", help="The config file (default: $XDG_CONFIG_HOME/tmax/config.toml).")),
    PRINT_CONFIG,
]


@setting_flags(RunKeys, "run", shared=_SHARED)
def run(
    task: Optional[str] = typer.Argument(None, help="What the agent should do. Asked for when omitted (not with --json)."),
    workdir: Optional[Path] = typer.Option(
        None, "--workdir", "-w", help="Starting directory (host path for local/bwrap, container path for podman)."
    ),
    json_mode: bool = typer.Option(False, "--json", help="Headless: one JSON event per line on stdout, no prompts."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the conversation saved in this run directory."),
    output: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Trajectory directory. Default: $XDG_DATA_HOME/tmax/runs/<timestamp>."
    ),
    output_old: Optional[Path] = typer.Option(None, "--output", hidden=True),  # the old spelling, with a note
    network: bool = typer.Option(False, "--network/--no-network", help="Network access inside bwrap/podman (off by default)."),
    harness: str = typer.Option("tmax", "--harness", help="Agent style: tmax (Vanillux2) | mini-swe | terminus-2."),
    undo_steps: int = typer.Option(
        0, "--undo-steps", min=0, help="Snapshot the files before each command so /undo [K] can restore them (last N kept; 0: off)."
    ),
    tokens: bool = typer.Option(
        False, "--tokens", help="Sample token ids from a vLLM server (tmax serve) and record tokens.json for `tmax learn --from-runs`."
    ),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="With --tokens: the model's tokenizer directory (default: the served model's)."),
    verify: Optional[str] = typer.Option(None, "--verify", help="Command run in the sandbox at the end; exit status 0 stores reward 1, else 0."),
    expose: list[str] = typer.Option(
        [], "--expose", help="A credential path the bwrap jail masks by default (~/.ssh, ~/.aws, ...) to show inside; repeatable."
    ),
    yes: bool = typer.Option(False, "--yes", help="Do not ask before making your whole home directory the bwrap workspace."),
    instructions: Optional[Path] = typer.Option(
        None, "--instructions", help="A file of project instructions for the system prompt, after the AGENTS.md files."
    ),
    no_instructions: bool = typer.Option(False, "--no-instructions", help="Do not read AGENTS.md files."),
    *,
    config: Optional[Path],
    print_config: bool,
    flags: FlagValues,
) -> None:
    """Run the agent on a task in a persistent shell.

    In confirm mode press Enter to run a command, or type why not (sent to the model); /y switches to yolo, /c back to confirm. Ctrl-C interrupts the model or the command and asks for guidance.

    Settings come from flags, then environment (TMAX_<KEY>), then $XDG_CONFIG_HOME/tmax/config.toml (~/.config/tmax/config.toml, or -c FILE); --print-config shows them.
    """
    if output is None and output_old is not None:
        note_old_spelling("--output", "--out")
        output = output_old
    try:
        if json_mode and not task:
            raise ConfigError("--json needs the task (or, with --resume, the follow-up) as an argument")
        if json_mode and undo_steps:
            raise ConfigError("--undo-steps needs the interactive UI (/undo), not --json")
        if config is not None and not config.is_file():
            raise ConfigError(f"config file not found: {config}")
        settings = resolve_run_settings(path=config, expose=expose, labels=flags.labels, need_base_url=not print_config,
                                        **flags.flat())
        if print_config:
            print_config_lines(describe_values(settings.shown(), settings.sources))
            raise typer.Exit(0)
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
            from tmax.cli.run_tokens import prepare_tokens

            token_setup = prepare_tokens(settings.base_url, settings.model, settings.api_key, tokenizer)
    except (ConfigError, ValueError) as e:
        raise _fail(str(e), json_mode) from None
    from tmax.cli.run_drive import RunRequest, drive

    raise typer.Exit(drive(RunRequest(settings, spec, task, json_mode, saved, resume, output, harness=harness,
                                      undo_steps=undo_steps, token_setup=token_setup,
                                      verify=verify, instructions=project)))


def register(app: typer.Typer) -> None:
    app.command("run", help=f"{inspect.cleandoc(run.__doc__ or '')}\n\n{_EXIT_HELP}")(run)
