"""Forking a live sandbox: a child that starts in the parent's state, isolated from it.

What is carried: the files (each backend copies or freezes them: `LocalSandbox.fork`,
`BwrapSandbox.fork`, `OverlaySandbox.fork`), and the shell's state: its cwd, exported
variables, options, functions and aliases, read from the parent's shell with builtins and
replayed into the child's new shell (`capture_state`, `restore_state`). What is not: processes.
The child's shell is a new bash; a process other than the shell that runs in the parent at
the fork is named in the fork's record (`base.ForkRecord.background`), found on this host
under the sandbox's process tree (`background_processes`). Unexported variables and jobs are
not carried either, as after a shell restart (`shell_setup.LOST_STATE`).
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from tmax.sandbox.base import BackgroundProcess, SandboxError
from tmax.sandbox.shell import PersistentShell
from tmax.sandbox.shell_setup import HARNESS_FUNCTIONS, NO_TTY_VARS, restore_state_text

# A fork's state reaches the child's new shell in this variable of its environment (read once,
# then unset), unless it is longer than one variable may be (then typed in: slower).
HANDOVER_VAR = "__TMAX_HANDOVER"
MAX_HANDOVER = 120_000
_SECTION = "#__tmax_section__"
# The prompt carries each shell's own marker: never carried (a local or overlay shell exports
# it, having had it in its environment at its start).
_PROMPT_VARS = ("PS0", "PS1", "PS2", "PROMPT_COMMAND", "HISTFILE", HANDOVER_VAR)
_NOT_LISTED = {*_PROMPT_VARS, *NO_TTY_VARS, "PWD", "OLDPWD", "SHLVL", "_"}
# Builtins only, no process: the functions are listed by name (`declare -F`) then printed whole
# (`declare -f`), and `split_functions` leaves out the harness's own (`__tmax_*`: its prompt,
# its state file), which stay the child shell's.
_CAPTURE = "\n".join([
    f"builtin printf '%s\\n' '{_SECTION}cwd' \"$PWD\" '{_SECTION}exports'",
    "builtin export -p",
    f"builtin printf '__tmax_opts=%q\\n__tmax_shopts=%q\\n' \"$SHELLOPTS\" \"$BASHOPTS\"",
    f"builtin printf '%s\\n' '{_SECTION}names'",
    "builtin declare -F",
    f"builtin printf '%s\\n' '{_SECTION}functions'",
    "builtin declare -f",
    f"builtin printf '%s\\n' '{_SECTION}aliases'",
    "builtin alias -p",
    f"builtin printf '%s\\n' '{_SECTION}end'",
])


@dataclass(frozen=True)
class ShellState:
    """A shell's state as bash code that puts it back (`restore_state`)."""

    cwd: str
    exports: str  # `export -p`, then the options as `__tmax_opts=` / `__tmax_shopts=`
    functions: str
    aliases: str

    def exported_names(self) -> list[str]:
        """The exported variables carried, less the harness's own (TERM, PAGER, ...)."""
        names = [line.split()[2].split("=", 1)[0] for line in self.exports.splitlines()
                 if line.startswith("declare -") and len(line.split()) > 2]
        return [n for n in names if n not in _NOT_LISTED]

    def function_names(self) -> list[str]:
        """The functions carried, less the harness's own (`vi`, `less`, ... that say no terminal)."""
        return [line.split(" ", 1)[1] for line in self.functions.splitlines()
                if line.startswith("#__tmax_function ") and line.split(" ", 1)[1] not in HARNESS_FUNCTIONS]

    def alias_names(self) -> list[str]:
        return [line[len("alias "):].split("=", 1)[0] for line in self.aliases.splitlines() if line.startswith("alias ")]

    def moved(self, old_root: str, new_root: str) -> ShellState:
        """The same state with a cwd under `old_root` moved under `new_root` (a copied workdir)."""
        cwd = Path(self.cwd)
        if cwd == Path(old_root) or Path(old_root) in cwd.parents:
            return replace(self, cwd=str(Path(new_root) / cwd.relative_to(old_root)))
        return self


def capture_state(shell: PersistentShell) -> ShellState:
    """The state of `shell` now, between commands."""
    out = shell.run_harness(_CAPTURE)
    sections: dict[str, list[str]] = {}
    current = None
    for line in out.split("\n"):
        if line.startswith(_SECTION):
            current = line[len(_SECTION):]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    if "end" not in sections or not sections.get("cwd"):
        raise SandboxError(f"fork: the shell's state could not be read: {out[-500:]}")
    prompt = tuple(f"declare -x {v}=" for v in _PROMPT_VARS)
    exports = [line for line in sections["exports"] if not line.startswith(prompt)]
    names = [line.split()[-1] for line in sections.get("names", []) if line.startswith("declare -f")]
    return ShellState(cwd=sections["cwd"][0], exports="\n".join(exports),
                      functions=split_functions(names, sections.get("functions", [])),
                      aliases="\n".join(sections["aliases"]))


def split_functions(names: list[str], lines: list[str]) -> str:
    """`declare -f`'s output (`lines`) as one `#__tmax_function NAME` block per function but
    the harness's own (`__tmax_*`). Each function starts at the line `NAME () ` of the next of
    `names` (`declare -F`'s list, in the same order), searched for from where the last began."""
    starts: list[tuple[int, str]] = []
    at = 0
    for name in names:
        header = f"{name} () "
        at = next((i for i in range(at, len(lines)) if lines[i] == header), -1)
        if at < 0:
            raise SandboxError(f"fork: the function {name!r} could not be read from the shell")
        starts.append((at, name))
    out = []
    for k, (i, name) in enumerate(starts):
        if not name.startswith("__tmax_"):
            end = starts[k + 1][0] if k + 1 < len(starts) else len(lines)
            out += [f"#__tmax_function {name}", *lines[i:end]]
    return "\n".join(out)


def restore_script(state: ShellState) -> str:
    """The bash that puts `state` into a new shell; it prints cwd= (the directory it is in)."""
    text = "\n".join([state.exports, f"__tmax_cwd={shlex.quote(state.cwd)}"])
    return restore_state_text(text, state.functions + "\n" + state.aliases)


def handover_vars(state: ShellState) -> dict[str, str]:
    """What a child's new shell starts with in its environment for `restore_state` to read."""
    script = restore_script(state)
    return {HANDOVER_VAR: script} if len(script.encode()) < MAX_HANDOVER else {}


# What a new shell started with `handover_vars` runs to take the state (`PersistentShell.after_start`).
RESTORE_HANDED_OVER = f'builtin eval "${HANDOVER_VAR}"; builtin unset {HANDOVER_VAR}'


def restore_state(shell: PersistentShell, state: ShellState, handed_over: bool) -> str:
    """Put `state` into `shell` (a new one, started with `handover_vars(state)` in its
    environment when `handed_over`); what it printed (cwd=)."""
    return shell.run_harness(RESTORE_HANDED_OVER if handed_over else restore_script(state)).strip()


def _inner_pid(p: psutil.Process) -> int:
    """A process's pid in its innermost pid namespace."""
    try:
        for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return p.pid


def _descendants(root_pid: int) -> list[int]:
    """The processes under `root_pid`, from the kernel's list of each thread's children (no scan
    of every process of the machine); psutil's scan where the kernel keeps no such list."""
    if not Path(f"/proc/{root_pid}/task").is_dir():
        return []
    if not Path(f"/proc/{root_pid}/task/{root_pid}/children").exists():
        try:
            return [p.pid for p in psutil.Process(root_pid).children(recursive=True)]
        except psutil.Error:
            return []
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                kids = [int(c) for c in tasks.read_text().split()]
            except (OSError, ValueError):
                continue  # ended meanwhile
            found += kids
            todo += kids
    return found


def background_processes(root_pid: int | None, shell_inner_pid: int | None) -> list[BackgroundProcess]:
    """The processes under `root_pid` on this host other than the shell (`shell_inner_pid`, as
    its sandbox sees it) and bubblewrap's own, oldest first."""
    if root_pid is None:
        return []
    found = []
    for pid in sorted(set(_descendants(root_pid))):
        try:
            p = psutil.Process(pid)
            inner = _inner_pid(p)
            if inner == shell_inner_pid or p.name() == "bwrap":
                continue
            found.append(BackgroundProcess(pid=inner, command=shlex.join(p.cmdline()) or p.name()))
        except psutil.Error:
            continue  # ended meanwhile
    return found


def copy_tree(src: Path, dst: Path) -> None:
    """`src`'s contents into `dst` (made if missing), links, modes and times kept, sharing blocks
    where the filesystem can (reflinks)."""
    dst.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["cp", "-a", "--reflink=auto", "--", f"{src}/.", str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SandboxError(f"fork: copying {src} failed: {r.stderr.strip()[-500:]}")
