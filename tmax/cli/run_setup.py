"""Where a `tmax run` session starts from: the model the server serves, a saved session
to resume and the directory it ran in, the sandbox to create, the project's instructions,
and where the whole of a long command output is kept; and how it ends (the exit status of
each outcome), which both the command (`run_cmd`) and the run's body (`run_drive`) use."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from tmax.cli.run_settings import ConfigError, RunSettings, config_path, data_dir

# --------------------------------------------------------------------------- how a run ends
# Exit status by outcome, so scripts can branch on it (documented in --help).
EXIT_CODES = {
    "submitted": 0,
    "max_steps": 3,
    "context_overflow": 4,
    "format_errors": 5,
    "model_error": 6,
    "sandbox_error": 7,
    "interrupted": 130,
    "internal_error": 1,
}
EXIT_USAGE = 2  # bad flags, config or resume path

# The model must know that a resumed session has a fresh shell, or it will rely on state
# (cwd, variables, background jobs) that no longer exists.
RESUME_NOTE = (
    "[The session was resumed in a new shell: the working directory, shell variables and "
    "background jobs from before are gone; files on disk are as the sandbox left them.]"
)


# --------------------------------------------------------------------------- model
def discover_model(base_url: str, api_key: str) -> str:
    """The one model a server serves (vLLM serves one); several or none is a usage error."""
    from openai import OpenAI

    from tmax.cli.run_settings import env_vars

    how = (
        f"Name it with the --model flag, the environment variable {' / '.join('$' + e for e in env_vars('model'))}, "
        f"or `model = \"...\"` in the config file {config_path()}."
    )
    try:
        models = list(OpenAI(base_url=base_url, api_key=api_key, timeout=10, max_retries=0).models.list())
    except Exception as e:  # any failure here means: ask the user to name the model
        raise ConfigError(f"no model given, and listing the models at {base_url} failed ({type(e).__name__}: {e}). {how}") from e
    ids = [m.id for m in models]
    # A LoRA server (`tmax serve --lora`) lists its base and the adapter (whose `parent` is
    # the base): the adapter is what it was started to serve.
    adapters = [m.id for m in models if (m.model_extra or {}).get("parent")]
    if len(adapters) == 1:
        return adapters[0]
    if len(ids) != 1:
        raise ConfigError(f"no model given, and {base_url} serves {len(ids)} models ({', '.join(ids) or 'none'}). {how}")
    return ids[0]


# --------------------------------------------------------------------------- resume
def load_saved(path: Path):
    """A saved run (`agents.recorder.SavedRun`) to continue; anything else is a usage error."""
    from tmax.agents.recorder import load_run

    try:
        saved = load_run(path)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot resume from {path}: {e}") from e
    if len(saved.messages) < 2 or saved.messages[0].get("role") != "system":
        raise ConfigError(f"cannot resume from {path}: the trajectory does not start with the system prompt")
    return saved


def saved_workdir(run_dir: Path, sandbox: str) -> Optional[Path]:
    """The working directory the saved session ran in, so the resumed one sees its files."""
    from tmax.common.records import RunRecord, SessionDir, read_record

    try:
        where = read_record(SessionDir(run_dir).run, RunRecord).workdir
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot resume from {run_dir}: its run.json, which names the working directory, "
                          f"cannot be read ({e}); pass --workdir to say where to continue") from e
    if sandbox == "podman":
        return Path(where) if where else None  # a path inside the container; None: the image's WORKDIR
    if not where:
        raise ConfigError(f"cannot resume from {run_dir}: run.json names no working directory; pass --workdir")
    if sandbox != "podman" and not Path(where).is_dir():
        raise ConfigError(f"cannot resume from {run_dir}: its working directory {where} no longer exists;"
                          " pass --workdir to continue somewhere else")
    return Path(where)


# --------------------------------------------------------------------------- instructions
def project_instructions(file: Optional[Path], off: bool, sandbox: str, workdir: Optional[str], resuming: bool):
    """The project instructions for the system prompt (`agents.instructions.Instructions`),
    or None: AGENTS.md files from the working directory up to the repository root (host
    sandboxes; a container's files are not the host's), then `file`. A resumed session keeps
    the instructions its saved system prompt holds."""
    from tmax.agents.instructions import InstructionsError, agents_files, load_instructions

    if off and file is not None:
        raise ConfigError("--instructions FILE and --no-instructions contradict each other: give one")
    if resuming:
        if file is not None:
            raise ConfigError("--instructions: a resumed session keeps the instructions it started with")
        return None
    files = agents_files(Path(workdir)) if not off and sandbox != "podman" and workdir else []
    try:
        loaded = load_instructions([*files, *([file.expanduser().absolute()] if file is not None else [])])
    except InstructionsError as e:
        raise ConfigError(str(e)) from None
    return loaded if loaded.sources else None


def keep_long_output(run_dir: Optional[Path], step: int, result: Any, limit: int) -> Optional[Path]:
    """Write a command's output to `outputs/step-N.txt` in the run directory when the model
    (more than `limit` characters, or less room in the context window: then the agent loop
    kept it already) or the screen (too many lines) gets only part of it."""
    from tmax.cli.ui import SCREEN_HEAD_LINES, SCREEN_TAIL_LINES

    from tmax.agents.recorder import save_output
    from tmax.common.records import SessionDir

    text = result.output or ""
    if run_dir is None:
        return None
    kept = SessionDir(run_dir).output(step)
    if kept.is_file():  # cut to fit the context window: the loop kept it
        return kept
    if len(text) + result.dropped_chars <= limit and text.count("\n") <= SCREEN_HEAD_LINES + SCREEN_TAIL_LINES:
        return None
    return save_output(run_dir, step, text)  # past 1 MB the shell kept head and tail, marked


def broad_workspace(sandbox: str, host_dir: Path) -> Optional[str]:
    """Why a jail with this working directory would hardly be one (None when it is fine):
    the workspace is the one writable place, so $HOME or / makes every file there writable."""
    if sandbox != "bwrap":
        return None
    if host_dir == Path("/"):
        raise ConfigError("the bwrap jail cannot make / its workspace (that is the whole host, writable); "
                          "start from a project directory or pass --workdir DIR (-e local runs on the host unjailed)")
    if host_dir == Path.home().resolve():
        return (f"the workspace would be your whole home directory {host_dir}: every file in it, "
                "dotfiles included, becomes writable for the agent")
    return None


def sandbox_spec(settings: RunSettings, workdir: Optional[Path], network: bool):
    from tmax.sandbox.base import SandboxSpec

    if settings.sandbox == "podman":
        # --workdir is a path inside the container; default: the image's WORKDIR.
        return SandboxSpec(image=settings.image, workdir=str(workdir) if workdir else None, network=network)
    host_dir = (workdir or Path.cwd()).resolve()
    if not host_dir.is_dir():
        raise ConfigError(f"--workdir {host_dir} is not a directory")
    if settings.sandbox == "bwrap":
        # The working directory is the one writable place in the otherwise read-only host;
        # tmax's own files (the config may hold the API key; past runs and the typed-prompt
        # history hold other sessions) are masked like other credentials.
        return SandboxSpec(workdir=str(host_dir), workspace=host_dir, network=network,
                           masked=[str(config_path().parent), str(data_dir())], exposed=list(settings.expose))
    return SandboxSpec(workdir=str(host_dir))
