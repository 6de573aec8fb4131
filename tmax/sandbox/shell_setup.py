"""What every persistent shell is set up with before its first command (`sandbox.shell`):
no terminal for commands (pagers print through, editors and full-screen programs fail at
once with a note, programs reading empty stdin say so), and the saved state a restarted
shell takes back (cwd, exported variables, options)."""

from __future__ import annotations

import shlex

# Commands have no terminal to talk to (stdin is /dev/null, nobody types): pagers print
# straight through, and full-screen editors fail at once with a note instead of waiting
# for keys until the timeout. The user's own definitions made later still win.
_NO_TTY_NOTE = ("needs an interactive terminal, and commands here have none; edit files with"
                " sed -i, ed, python or a heredoc (cat > FILE <<EOF), and read them with cat, head or sed -n")
_NO_INPUT_NOTE = ("got no input: standard input is empty for commands here (nobody types); pass input with a"
                  " heredoc (<<'EOF' ... EOF), a pipe or a file, and code with python3 -c 'CODE'")
_NO_EDITOR = f"sh -c 'echo \"tmax: an editor {_NO_TTY_NOTE}\" >&2; exit 1' tmax-no-editor"
# Vim started by path (`/usr/bin/vi`), past the shell functions below, would wait for keys
# on the pty: its init quits at once when input is not a terminal, unless it runs as a
# script (`vim -e`/`-es`), and then reads the user's vimrc as usual.
_VIMINIT = ("if (!has('ttyin') || !empty($TMAX_NO_TTY)) && empty(filter(copy(v:argv), 'v:val =~# \"^-[eE]\"'))"
            f" | echoerr 'tmax: vim {_NO_TTY_NOTE}.' | cquit | endif"
            " | if filereadable(expand('~/.vimrc')) | source ~/.vimrc | endif")
# What NO_TTY_SETUP exports: a program that does get a terminal (a tmux session) starts without it.
_EDITORS = "vi vim nvim view vimdiff nano pico emacs joe mcedit"
_PAGERS = "less more most"
NO_TTY_VARS = ("PAGER", "GIT_PAGER", "MANPAGER", "SYSTEMD_PAGER", "EDITOR", "VISUAL", "GIT_EDITOR", "VIMINIT",
               "TMAX_NO_TTY")
NO_TTY_SETUP = [
    "export TERM=dumb PAGER=cat GIT_PAGER=cat MANPAGER=cat SYSTEMD_PAGER=''",
    f"export EDITOR={shlex.quote(_NO_EDITOR)} VISUAL={shlex.quote(_NO_EDITOR)} GIT_EDITOR={shlex.quote(_NO_EDITOR)}",
    f"export VIMINIT={shlex.quote(_VIMINIT)}",
    f"__tmax_no_tty() {{ echo \"tmax: $1 {_NO_TTY_NOTE}.\" >&2; return 1; }}",
    f"for __tmax_p in {_EDITORS}; do"
    " eval \"$__tmax_p() { __tmax_no_tty $__tmax_p; }\"; done",
    f"for __tmax_p in {_PAGERS}; do"
    " eval \"$__tmax_p() { command $__tmax_p \\\"\\$@\\\" | cat; return \\${PIPESTATUS[0]}; }\"; done",
    # `watch` redraws until a key stops it; `top` and `htop` likewise: fail at once or print once.
    "watch() { echo \"tmax: watch repeats until a key stops it, and nobody types here; run the command once,"
    " or a bounded loop: for i in 1 2 3; do CMD; sleep 2; done\" >&2; return 1; }",
    "htop() { __tmax_no_tty htop; }; btop() { __tmax_no_tty btop; }",
    "top() { case \" $* \" in *' -b'*|*' -n'*) command top \"$@\";; *) command top -b -n 1 \"$@\";; esac; }",
    # `script` gives its command a terminal of its own, which nobody types into: vim there
    # must still quit at once (VIMINIT reads TMAX_NO_TTY).
    "script() { TMAX_NO_TTY=1 command script \"$@\"; }",
    # Programs that read their input from stdin find it empty: say so instead of a silent no-op.
    f"__tmax_no_input() {{ echo \"tmax: $1 {_NO_INPUT_NOTE}\" >&2; }}",
    "for __tmax_p in python python3; do eval \"$__tmax_p() { if [ \\$# -eq 0 ] && [ /dev/stdin -ef /dev/null ];"
    " then __tmax_no_input '$__tmax_p with no script'; fi; command $__tmax_p \\\"\\$@\\\"; }\"; done",
    "read() { builtin read \"$@\" && return 0; set -- $?;"
    " [ /dev/stdin -ef /dev/null ] && __tmax_no_input read; return $1; }",
    "unset __tmax_p",
]

# The functions NO_TTY_SETUP defines (besides its `__tmax_*` helpers).
HARNESS_FUNCTIONS = frozenset([*_EDITORS.split(), *_PAGERS.split(), "watch", "htop", "btop", "top", "script",
                               "python", "python3", "read"])

LOST_STATE = "lost: unexported variables, functions, aliases and background jobs"
# Options the harness owns (history off) or that belong to the terminal, never restored.
_OWN_OPTIONS = "history|emacs|vi|monitor|interactive-comments|posix|onecmd|noexec"


# Where a shell finds `init_script` and `setup_script` in its environment (`PersistentShell.setup_in_env`).
INIT_VAR, SETUP_VAR = "__TMAX_INIT", "__TMAX_SETUP"


def init_script(tag: str, typed: bool = True) -> str:
    """The first line a persistent shell runs: readline and history settings, and the prompt
    carrying the marker of its session (`tag`) that says where each command ends. Echo is
    turned off where it is `typed` in; a shell that reads it from its environment has a
    terminal made without echo (`ptyspawn`, the episode helper's), and is spared a process."""
    # The marker is written split across two quoted strings ('__TM''AX_...') so the tty echo of
    # this very line (before `stty -echo` takes effect), when it is typed in, cannot match it.
    return (
        ("stty -echo 2>/dev/null; " if typed else "")
        + "bind 'set enable-bracketed-paste off' 2>/dev/null; "
        "bind 'set disable-completion on' 2>/dev/null; "  # tabs in commands stay tabs
        "bind 'set convert-meta off' 2>/dev/null; bind 'set input-meta on' 2>/dev/null; "
        "bind 'set output-meta on' 2>/dev/null; "
        f"set +o history +H; unset HISTFILE PROMPT_COMMAND {INIT_VAR}; shopt -s expand_aliases; "
        "PS0=''; PS2=''; __tmax_ret() { return \"$1\"; }; "
        f"PS1='\\n__TM''AX_{tag}_${{__tmax_seq}}_$?__\\n'"
    )


def setup_script(state_file: str, env: dict[str, str]) -> str:
    """What a persistent shell runs once started: no terminal for commands, its state saved
    before each command (into `state_file`), the variables of `env` exported; it prints its pid."""
    # The saved state may hold secrets from the environment: only this user may read it.
    state = shlex.quote(state_file)
    setup = [*NO_TTY_SETUP, save_state_function(state_file),
             f"[ -e {state} ] || (umask 077; : > {state}) 2>/dev/null", "echo $$"]
    setup += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(setup)


def save_state_function(path: str) -> str:
    """`__tmax_save`: cwd, exported variables and options into `path`, with builtins only
    (it runs before every command; a process per command would cost milliseconds). The file
    is overwritten in place, not truncated (on ext4 a truncate-and-rewrite waits for the disk,
    ~4 ms), and ends in `return`, so what an earlier, longer state left after it is never read."""
    return (f"__tmax_save() {{ {{ builtin export -p; builtin printf '__tmax_cwd=%q\\n__tmax_opts=%q\\n"
            f"__tmax_shopts=%q\\nreturn 0\\n' \"$PWD\" \"$SHELLOPTS\" \"$BASHOPTS\"; }} 1<> {shlex.quote(path)} 2>/dev/null; }}")


def restore_state_script(path: str) -> str:
    """Run in a new shell: take back what `__tmax_save` wrote; prints cwd=, vars= and opts=."""
    q = shlex.quote(path)
    return _restore(f"[ -r {q} ] && . {q} >/dev/null 2>&1")


def restore_state_text(saved: str, definitions: str = "") -> str:
    """As `restore_state_script`, from `saved` (what `__tmax_save` writes, without its `return`),
    then `definitions` (functions, aliases), printing only cwd=: a forked sandbox's new shell
    (`sandbox.fork`), whose caller knows what it carried. One process (no `grep` per variable)."""
    return _restore(f"{{\n{saved}\n}} >/dev/null 2>&1", definitions, report=False)


def _restore(load: str, definitions: str = "", report: bool = True) -> str:
    said = [
        'printf "vars="; for __tmax_p in $(compgen -e); do case $__tmax_p in PWD|OLDPWD|SHLVL|_) continue;; esac;'
        ' grep -qxF -- "$(declare -p "$__tmax_p")" <<<"$__tmax_env0" || printf "%s " "$__tmax_p"; done; echo',
        'printf "opts="; for __tmax_p in ${SHELLOPTS//:/ } ${BASHOPTS//:/ }; do'
        ' case $__tmax_o0 in *":$__tmax_p:"*) ;; *) printf "%s " "$__tmax_p";; esac; done; echo',
    ]
    return "\n".join([
        *(["__tmax_env0=$(builtin export -p); __tmax_o0=:$SHELLOPTS:$BASHOPTS:"] if report else []),
        f"__tmax_cwd=; {load}",
        'if [ -n "$__tmax_cwd" ] && builtin cd -- "$__tmax_cwd" 2>/dev/null; then echo "cwd=$PWD"; else echo cwd=; fi',
        f'for __tmax_p in ${{__tmax_opts//:/ }}; do case $__tmax_p in {_OWN_OPTIONS}) ;; *) set -o "$__tmax_p";; esac; done',
        'for __tmax_p in ${__tmax_shopts//:/ }; do shopt -s "$__tmax_p" 2>/dev/null; done',
        *(said if report else []),
        "unset __tmax_p __tmax_env0 __tmax_o0 __tmax_cwd __tmax_opts __tmax_shopts",
        *([f"{{\n{definitions}\n}} >/dev/null 2>&1"] if definitions.strip() else []),
    ])


def restored_note(printed: str | None) -> str:
    """What the model is told after a restart, from what `restore_state_script` printed
    (None: it failed)."""
    lines = dict(line.split("=", 1) for line in (printed or "").splitlines() if "=" in line)
    if "cwd" not in lines:
        return f"{LOST_STATE}; nothing could be restored (the saved state was unreadable)"
    restored = [f"cwd {lines['cwd']}" if lines["cwd"] else "cwd (its directory is gone: back in the start directory)"]
    names = lines.get("vars", "").split()
    restored.append(f"exported variables ({', '.join(names)})" if names else "no exported variables of your own")
    if lines.get("opts", "").strip():
        restored.append(f"shell options ({lines['opts'].strip()})")
    return f"restored {'; '.join(restored)}; {LOST_STATE}"
