"""The persistent shell on host bash: every behaviour the agent relies on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tmax.sandbox.base import SandboxError
from tmax.sandbox.shell import PersistentShell, clean_output
from tmax.sandbox.shell_setup import _NO_INPUT_NOTE


@pytest.fixture
def sh(tmp_path):
    s = PersistentShell(workdir=str(tmp_path), interrupt_grace_s=2.0)
    s.start()
    yield s
    s.close()


def test_starts_in_workdir_and_reports_output(sh, tmp_path):
    r = sh.run("pwd")
    assert r.output == f"{tmp_path}\n"
    assert r.exit_code == 0 and not r.timed_out and r.note is None


def test_state_persists(sh, tmp_path):
    (tmp_path / "sub").mkdir()
    r = sh.run("cd sub; plain=1; export EXPORTED=2; greet() { echo hello-$1; }; alias ll='echo via-alias'")
    assert r.exit_code == 0, r.output
    sh.run("set -o pipefail; set -u; trap 'echo trapped' USR1")
    r = sh.run('pwd; echo "$plain $EXPORTED"; greet x; ll; set -o | grep -E "^(pipefail|nounset) "')
    lines = r.output.splitlines()
    assert lines[0] == str(tmp_path / "sub")
    assert lines[1] == "1 2"
    assert lines[2] == "hello-x"
    assert lines[3] == "via-alias"
    assert [ln.split()[1] for ln in lines[4:]] == ["on", "on"]
    assert sh.run("kill -USR1 $$").output == "trapped\n"


def test_background_jobs_persist(sh):
    r = sh.run("sleep 30 & echo started")
    assert "started" in r.output
    r = sh.run("jobs")
    assert "Running" in r.output and "sleep 30" in r.output
    assert sh.run("kill %1; wait %1; echo $?").output.strip().endswith("143")


def test_exit_codes(sh):
    assert sh.run("true").exit_code == 0
    assert sh.run("false").exit_code == 1
    assert sh.run("(exit 42)").exit_code == 42
    assert sh.run("no-such-command-xyz").exit_code == 127
    r = sh.run("echo 'unbalanced")  # a syntax error must not leave the shell waiting
    assert r.exit_code == 2 and "unexpected EOF" in r.output and not r.timed_out
    assert sh.run("echo fine").output == "fine\n"


def test_output_without_trailing_newline_and_blank_lines(sh):
    assert sh.run("printf abc").output == "abc"
    assert sh.run("printf 'a\\n\\n'").output == "a\n\n"
    assert sh.run(":").output == ""


def test_multiline_and_heredoc(sh, tmp_path):
    cmd = "cat > f.txt <<'EOF'\nline $HOME\n\tindented\nEOF\nfor i in 1 2; do\n  echo n$i\ndone\ncat f.txt"
    r = sh.run(cmd)
    assert r.output == "n1\nn2\nline $HOME\n\tindented\n"
    assert (tmp_path / "f.txt").read_text() == "line $HOME\n\tindented\n"
    # An alias defined on one line applies to the next line of the same command.
    assert sh.run("alias hi='echo hi-alias'\nhi").output == "hi-alias\n"


def test_forged_marker_is_ignored(sh):
    fake = "__TMAX_0123456789abcdef_1_0__"
    r = sh.run(f"echo; echo {fake}; echo '__TMAX_{sh.tag[:8]}'; echo \"$PS1\"; echo after; exit_code_is=3; (exit 5)")
    assert fake in r.output and "after" in r.output
    assert r.exit_code == 5
    assert sh.run("echo next").output == "next\n"


def test_large_output_is_bounded(tmp_path):
    s = PersistentShell(workdir=str(tmp_path), max_output_chars=100_000)
    s.start()
    try:
        t0 = time.monotonic()
        r = s.run("head -c 3750000 /dev/zero | base64 -w 100; echo END", timeout=60)
        assert time.monotonic() - t0 < 30
        assert r.exit_code == 0
        assert r.dropped_chars > 4_900_000
        assert len(r.output) < 110_000
        assert r.output.startswith("AAAA") and r.output.endswith("END\n")
        assert "characters dropped" in r.output
        assert s.run("echo ok").output == "ok\n"
    finally:
        s.close()


def test_five_megabytes_default_window(sh):
    r = sh.run("head -c 3750000 /dev/urandom | base64 -w 100", timeout=60)
    assert r.exit_code == 0
    assert 990_000 <= len(r.output) <= 1_010_000
    assert r.dropped_chars + len(r.output) > 4_900_000


def test_timeout_interrupts_and_keeps_state(sh):
    sh.run("cd /; KEEP=yes")
    t0 = time.monotonic()
    r = sh.run("echo partial; sleep 100", timeout=1)
    assert time.monotonic() - t0 < 4
    assert r.timed_out and r.exit_code == 124
    assert "partial" in r.output
    assert "timed out" in r.note
    r = sh.run("pwd; echo $KEEP")
    assert r.output == "/\nyes\n"


def test_timeout_when_ctrl_c_is_ignored_kills_the_command_group(sh):
    sh.run("cd /; trap '' INT")
    t0 = time.monotonic()
    r = sh.run("sleep 100 | cat", timeout=1)
    assert r.timed_out and r.exit_code == 124 and "interrupted" in r.note
    assert time.monotonic() - t0 < 15
    assert sh.run("pwd").output == "/\n"  # the same shell: no restart was needed


def test_timeout_when_the_shell_itself_ignores_ctrl_c_restarts(sh):
    sh.run("cd /; trap '' INT")
    r = sh.run("while :; do :; done", timeout=1)  # a builtin loop: nothing to kill but the shell
    assert r.timed_out and r.exit_code == 124 and "restarted" in r.note
    r = sh.run("pwd")  # a fresh shell, back where the old one was
    assert r.exit_code == 0 and r.output.strip() == "/"


def test_force_interrupt_kills_the_whole_foreground_group(sh):
    threading.Timer(0.5, sh.interrupt, kwargs={"force": True}).start()
    t0 = time.monotonic()
    r = sh.run("bash -c \"trap '' INT; sleep 100 | cat\"; echo after=$?", timeout=30)
    assert time.monotonic() - t0 < 5 and r.output.endswith("after=137\n")


def test_stdin_readers_do_not_hang(sh):
    t0 = time.monotonic()
    r = sh.run("cat; read -r x; echo read=$?; python3 -c 'import sys; print(len(sys.stdin.read()))'", timeout=10)
    assert time.monotonic() - t0 < 5
    assert r.output.splitlines() == [f"tmax: read {_NO_INPUT_NOTE}", "read=1", "0"]


def test_exit_restarts_with_note(sh):
    sh.run("export KEPT=1; PLAIN=1")
    r = sh.run("exit 7")
    assert r.exit_code == 7
    assert "exited" in r.note and "restarted" in r.note and "exported variables (KEPT" in r.note
    assert "lost: unexported variables, functions, aliases and background jobs" in r.note
    r = sh.run("echo ${KEPT:-unset} ${PLAIN:-unset}")
    assert r.output == "1 unset\n" and r.note is None


def test_dead_shell_is_restarted(sh):
    os.kill(sh.inner_pid, signal.SIGKILL)
    time.sleep(0.2)
    r = sh.run("echo back")
    assert r.output == "back\n"
    assert r.note and "restarted" in r.note
    assert sh.restarts == 1


def test_ansi_and_carriage_returns_stripped(sh):
    r = sh.run(r"printf '\033[1;31mred\033[0m \033]0;title\007plain\n'; printf 'progress 10%%\rprogress 100%%\r\n'")
    assert r.output == "red plain\nprogress 100%\n"
    assert "\r" not in r.output and "\x1b" not in r.output


def test_invalid_utf8_is_replaced(sh):
    r = sh.run(r"printf 'ok \xff\xfe end\n'; echo 'héllo ✓'")
    assert r.output == "ok \ufffd\ufffd end\nhéllo ✓\n"


def test_tabs_and_control_characters_in_commands(sh):
    assert sh.run("printf 'a\\tb\\n'; echo 'x\ty'").output == "a\tb\nx\ty\n"
    # A stray Ctrl-C byte inside the command text must not interrupt anything.
    assert sh.run("echo ok\x03").output == "ok\n"


def test_interrupt_from_another_thread(sh):
    threading.Timer(0.5, sh.interrupt).start()
    t0 = time.monotonic()
    r = sh.run("sleep 30; echo not-reached", timeout=20)
    assert time.monotonic() - t0 < 5
    assert not r.timed_out and r.exit_code == 130 and r.note == "interrupted"
    assert "not-reached" not in r.output
    sh.interrupt()  # idle: must be a no-op, not a stray prompt
    assert sh.run("echo still").output == "still\n"


def test_env_and_long_command(tmp_path):
    s = PersistentShell(env={"GREETING": "hi there", "QUOTE": "a'b\"c"}, workdir=str(tmp_path))
    s.start()
    try:
        assert s.run('echo "$GREETING|$QUOTE"').output == "hi there|a'b\"c\n"
        long = "x" * 20000
        assert s.run(f"echo {long} | wc -c").output.strip() == "20001"
    finally:
        s.close()


def test_overhead_per_command(sh):
    t0 = time.monotonic()
    for i in range(100):
        assert sh.run(f"echo {i}").output == f"{i}\n"
    assert (time.monotonic() - t0) / 100 < 0.05


def test_clean_output_helper():
    assert clean_output("a\r\nb\r\n") == "a\nb\n"
    assert clean_output("\x1b[2K\x1b[1Gdone") == "done"


def test_previous_exit_code_visible_and_set_e(sh):
    sh.run("false")
    assert sh.run("echo $?").output == "1\n"
    assert sh.run("echo $?").output == "0\n"
    # `set -e` persists; a failing command then ends the shell, which is restarted.
    sh.run("set -e")
    assert sh.run("true").note is None
    r = sh.run("false")
    assert r.exit_code == 1 and "restarted" in r.note
    assert sh.run("echo fine").output == "fine\n"


def test_children_start_with_default_signals(tmp_path):
    """A tmax started in the background ignores SIGINT (and Python ignores SIGPIPE): the
    shell's commands and one-off processes must not inherit that."""
    from tmax.sandbox.hostexec import run_process

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        s = PersistentShell(workdir=str(tmp_path))
        s.start()
        one_off = run_process(["sh", "-c", "grep SigIgn /proc/self/status"])
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        assert s.run("sh -c 'grep SigIgn /proc/self/status'").output == "SigIgn:\t0000000000000000\n"
        assert s.run("yes | head -1").output == "y\n"  # SIGPIPE ends `yes` quietly
    finally:
        s.close()
    assert one_off.output == "SigIgn:\t0000000000000000\n"


def test_children_start_without_forking_tmax_even_when_it_ignores_signals(tmp_path):
    """A fork of a driver holding torch costs it tens of ms of CPU and a fault on every page
    it writes afterwards. tmax started in the background ignores SIGINT and SIGQUIT; its
    children still start through vfork (Python's fork hooks never run) and with defaults."""
    from tmax.sandbox.hostexec import run_process

    forks = []
    os.register_at_fork(before=lambda: forks.append(1))
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:
        s = PersistentShell(workdir=str(tmp_path))
        s.start()
        try:
            assert s.run("grep SigIgn /proc/self/status").output == "SigIgn:\t0000000000000000\n"
        finally:
            s.close()
        assert run_process(["grep", "SigIgn", "/proc/self/status"]).output == "SigIgn:\t0000000000000000\n"
        with pytest.raises(SandboxError, match="could not run no-such-program"):
            run_process(["no-such-program"])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    assert forks == []


def test_children_start_with_no_signal_blocked():
    """Ray blocks SIGINT in its workers' threads; a child inherits its spawning thread's mask."""
    from tmax.sandbox.hostexec import run_process
    from tmax.sandbox.ptyspawn import PtyProcess

    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    try:
        one_off = run_process(["grep", "SigBlk", "/proc/self/status"])  # not through sh: dash clears it
        on_pty = PtyProcess(["grep", "SigBlk", "/proc/self/status"], dict(os.environ))
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) >= {signal.SIGINT, signal.SIGTERM}  # this thread's kept
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    out = b""
    try:
        while True:
            out += on_pty.read_nonblocking(4096, timeout=10)
    except EOFError:
        pass
    on_pty.close()
    assert one_off.output == "SigBlk:\t0000000000000000\n"
    assert out.replace(b"\r", b"") == b"SigBlk:\t0000000000000000\n" and on_pty.exitstatus == 0


def test_programs_that_need_a_terminal_fail_fast(sh, tmp_path):
    (tmp_path / "f.txt").write_text("one\ntwo\n")
    t0 = time.monotonic()
    r = sh.run("vi f.txt", timeout=30)
    assert r.exit_code == 1 and "vi needs an interactive terminal" in r.output and time.monotonic() - t0 < 5
    # By path, past the shell function: vim's own init quits; vim as a script (-es) still works.
    t0 = time.monotonic()
    r = sh.run("/usr/bin/vim f.txt", timeout=30)
    assert r.exit_code == 1 and "vim needs an interactive terminal" in r.output and time.monotonic() - t0 < 5
    assert sh.run("/usr/bin/vim -es -c '%s/one/uno/' -c wq f.txt && head -1 f.txt").output == "uno\n"
    sh.run("sed -i s/uno/one/ f.txt")
    assert sh.run("less f.txt; less f.txt | wc -l").output == "one\ntwo\n2\n"  # pagers print through
    r = sh.run('sh -c "$EDITOR f.txt"; echo rc=$?; echo $TERM $PAGER $GIT_PAGER')
    assert r.output.startswith("tmax: an editor needs an interactive terminal") and r.output.endswith("rc=1\ndumb cat cat\n")


def test_full_screen_programs_fail_fast_and_empty_input_gets_a_note(sh, tmp_path):
    """`watch` and vim inside `script` used to wait for keys until the timeout; `python3` with
    no script and `read x` ended silently."""
    t0 = time.monotonic()
    r = sh.run("watch -n 1 date", timeout=20)
    assert r.exit_code == 1 and "tmax: watch repeats until a key stops it" in r.output
    r = sh.run("script -qc 'vim f.txt' /dev/null", timeout=20)
    assert "vim needs an interactive terminal" in r.output and not r.timed_out
    assert time.monotonic() - t0 < 10
    assert sh.run("top | head -1", timeout=20).output.startswith("top - ")  # printed once, not redrawn
    r = sh.run("python3; echo rc=$?")
    assert r.output == f"tmax: python3 with no script {_NO_INPUT_NOTE}\nrc=0\n"
    r = sh.run("read x; echo rc=$?")
    assert r.output == f"tmax: read {_NO_INPUT_NOTE}\nrc=1\n"
    # Input given any other way: no note, and read behaves as the builtin.
    r = sh.run("echo 'print(6*7)' | python3; IFS=: read a b <<< 'x:y'; echo $a-$b; printf '1\\n2\\n' | while read n; do echo n$n; done")
    assert r.output == "42\nx-y\nn1\nn2\n"


def test_the_shell_leads_its_own_session_on_its_own_terminal(sh):
    """The pty is the shell's controlling terminal (job control, Ctrl-C to the foreground
    group), set up in this process: no echo, 50 x 200, the shell a session leader."""
    assert sh.run("[ \"$(ps -o sid= -p $$ | tr -d ' ')\" = \"$$\" ] && echo leader").output == "leader\n"
    assert sh.run("ps -o tty= -p $$").output.startswith("pts/")  # its controlling terminal
    # stdin of a command is /dev/null: ask the shell's own terminal.
    assert sh.run("stty size < /dev/tty").output == "50 200\n"
    assert "-echo " in sh.run("stty -a < /dev/tty").output
    pid = sh._child.pid
    sh.close()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_spawn_benchmark_runs():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "shell_spawn.py"
    r = subprocess.run([sys.executable, str(script), "--shells", "2", "--rounds", "1", "--resident-mb", "1",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert all(out["median"][k]["wall_ms"] > 0 for k in ("pexpect", "ptyspawn")) and out["wall_pexpect_over_ptyspawn"] > 0
