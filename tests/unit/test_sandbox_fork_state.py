"""A shell's state as a fork carries it (`sandbox.fork`), on real bash: read from one shell with
builtins, put into a new one (through its environment, or typed in when too long for it);
and which sandboxes and pools say they can fork (`SandboxCapabilities`)."""

from __future__ import annotations

import pytest

from tmax.sandbox import SandboxSpec, sandbox_class
from tmax.sandbox.fork import HANDOVER_VAR, MAX_HANDOVER, ShellState, capture_state, handover_vars, restore_state
from tmax.sandbox.overlay_pool import OverlayPool, SpecFactory
from tmax.sandbox.pool import WarmPool
from tmax.sandbox.shell import PersistentShell


@pytest.fixture
def shells():
    made = []

    def make(state: ShellState | None = None) -> PersistentShell:
        sh = PersistentShell()
        if state is not None:
            sh.start_vars = handover_vars(state)
        sh.start()
        made.append(sh)
        return sh

    yield make
    for sh in made:
        sh.close()


def test_the_state_goes_from_one_shell_to_a_new_one(shells, tmp_path):
    (tmp_path / "d").mkdir()
    a = shells()
    a.run(f"cd {tmp_path}/d && export V='two words' W=$'line\\nbreak' && set -o pipefail && shopt -s globstar"
          " && greet() { echo \"hi $1\"; } && alias ll='echo aliased' && X=unexported")
    state = capture_state(a)
    assert {"V", "W"} <= set(state.exported_names()) and "X" not in state.exported_names()
    assert "greet" in state.function_names() and "vi" not in state.function_names()  # the harness's own left out
    assert state.alias_names() == ["ll"]
    b = shells(state)
    assert HANDOVER_VAR in b.start_vars
    assert restore_state(b, state, handed_over=True) == f"cwd={tmp_path}/d"
    r = b.run('pwd; echo "$V"; echo "$W"; greet x; ll; shopt -o pipefail | cut -f2; shopt globstar | cut -f2;'
              ' echo "[$X]"; echo "[${' + HANDOVER_VAR + '-gone}]"')
    assert r.output.strip().split("\n") == [f"{tmp_path}/d", "two words", "line", "break", "hi x", "aliased", "on", "on",
                                    "[]", "[gone]"]
    assert a.run("echo $$").output != b.run("echo $$").output


def test_a_state_too_long_for_the_environment_is_typed_in(shells):
    a = shells()
    a.run(f"export BIG=$(head -c {MAX_HANDOVER} /dev/zero | tr '\\0' x)")
    state = capture_state(a)
    assert handover_vars(state) == {}
    b = shells(state)
    restore_state(b, state, handed_over=False)
    assert b.run("echo ${#BIG}").output.strip() == str(MAX_HANDOVER)


def test_the_prompt_of_the_parent_is_never_carried(shells):
    """A shell's prompt carries its own random marker: the child keeps its own, or it would
    never see its commands end."""
    a = shells()
    state = capture_state(a)
    assert "PS1=" not in state.exports
    b = shells(state)
    restore_state(b, state, handed_over=True)
    assert b.run("echo ok").output.strip() == "ok"


def test_a_cwd_in_a_copied_directory_moves_with_it():
    s = ShellState(cwd="/w/p/sub", exports="", functions="", aliases="")
    assert s.moved("/w/p", "/tmp/c").cwd == "/tmp/c/sub"
    assert s.moved("/elsewhere", "/tmp/c").cwd == "/w/p/sub"


def test_which_sandboxes_fork():
    assert sandbox_class("local").capabilities.fork and sandbox_class("bwrap").capabilities.fork
    assert not sandbox_class("podman").capabilities.fork  # a container of its own: no frozen layers
    pool = WarmPool(1)
    assert pool.capabilities(SpecFactory("bwrap", SandboxSpec())).fork
    assert not pool.capabilities(SpecFactory("podman", SandboxSpec(image="x"))).fork


def test_an_overlay_pool_forks_only_what_its_overlay_serves(tmp_path):
    pool = OverlayPool(2, root=tmp_path / "hosts")
    writable = SandboxSpec(image="x", mounts=[(str(tmp_path), "/data", False)])
    assert not pool.capabilities(SpecFactory("podman", writable)).fork  # a container of its own
    assert pool.capabilities(SpecFactory("local", SandboxSpec())).fork
    single = OverlayPool(1, root=tmp_path / "hosts1")
    assert not single.capabilities(SpecFactory("podman", SandboxSpec(image="x"))).fork  # one episode a host


def test_functions_are_read_without_a_process_and_the_harness_own_left_out(shells):
    """An exported function stays exported; a heredoc in a body that reads like a function's
    header does not cut the functions wrong; the harness's `__tmax_*` stay the child's own."""
    a = shells()
    a.run("f() { echo hi; }; export -f f; g() { cat <<EOF\nf () \nEOF\n}")
    state = capture_state(a)
    assert {"f", "g"} <= set(state.function_names()) and not any(n.startswith("__tmax_") for n in state.function_names())
    b = shells(state)
    restore_state(b, state, handed_over=True)
    assert b.run("f; g; bash -c f").output.strip().split("\n") == ["hi", "f () ", "hi"]
    saves = b.run("declare -f __tmax_save").output
    assert b.state_file in saves and a.state_file not in saves  # its own, writing its own state file
