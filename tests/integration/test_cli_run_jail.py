"""What the bwrap jail of `tmax run` shows and refuses, end to end: the config file the docs
show (docs/run.md), tmax's own files, hard links to masked files, the jail's /proc, and workspaces that
would make the whole home writable.

The home directory lives under /var/tmp: the jail has a private /tmp, so masks of paths
under the host's /tmp would not be exercised."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from scripted_server import ScriptedServer
from tmax.cli.run_settings import bwrap_works

pytestmark = [pytest.mark.bwrap, pytest.mark.skipif(not bwrap_works(), reason="bubblewrap cannot run here")]

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
RUN_DOCS = Path(__file__).resolve().parents[2] / "docs" / "run.md"


@pytest.fixture
def home():
    d = Path(tempfile.mkdtemp(prefix="tmax-jail-test-", dir="/var/tmp"))
    (d / "home").mkdir()
    (d / "ws").mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _env(home: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_", "XDG_"))}
    e.update(HOME=str(home / "home"), NO_COLOR="1")
    return e


def documented_config(base_url: str, model: str) -> str:
    """docs/run.md's config example, pointed at the test's server."""
    block = re.search(r"```toml\n(\s*# ~/.config/tmax/config.toml\n.*?)```", RUN_DOCS.read_text(), re.S)
    assert block, "docs/run.md shows no config.toml example"
    text = "\n".join(line.strip() for line in block.group(1).splitlines())
    text = re.sub(r'base_url = ".*"', f'base_url = "{base_url}"', text)
    return re.sub(r'model = ".*"', f'model = "{model}"', text)


def run_json(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 90) -> tuple[int, list[dict], str]:
    proc = subprocess.run([sys.executable, "-m", "tmax.cli.main", "run", "--json", *args], env=env, cwd=str(cwd),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


def write_config(home: Path, srv: ScriptedServer) -> Path:
    cfg = home / "home" / ".config" / "tmax" / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(documented_config(srv.base_url, srv.model))
    return cfg


def test_documented_config_file_runs_in_the_jail_and_tmax_files_stay_hidden(home):
    """The documented config (api_key in ~/.config/tmax/config.toml) used to stop every bwrap
    run with exit 7 (a file mask inside the masked directory); past runs and the prompt
    history were readable, and /proc/1/cmdline showed the host's temp paths."""
    h = home / "home"
    (h / ".local/share/tmax/runs/old").mkdir(parents=True)
    (h / ".local/share/tmax/runs/old/trajectory.json").write_text("OLD-RUN-SECRET")
    (h / ".local/share/tmax/history").write_text("TYPED-PROMPT-SECRET")
    probe = (f"cat {h}/.config/tmax/config.toml; cat {h}/.local/share/tmax/history;"
             f" cat {h}/.local/share/tmax/runs/old/trajectory.json; tr '\\0' ' ' </proc/1/cmdline")
    with ScriptedServer([{"bash": probe}, {"bash": SUBMIT}], api_key="sk-your-key") as srv:
        write_config(home, srv)
        rc, events, stderr = run_json(["--workdir", str(home / "ws"), "go"], _env(home), home / "ws")
    assert rc == 0, stderr
    assert events[0]["sandbox"] == "bwrap"
    seen = next(e for e in events if e["type"] == "observation")["observation"]
    for secret in ("sk-your-key", "OLD-RUN-SECRET", "TYPED-PROMPT-SECRET", "tmax-bwrap-"):
        assert secret not in seen, (secret, seen)
    assert seen.count("No such file or directory") == 3, seen
    assert "\nbwrap --args 3 bash --norc --noprofile\n" in seen  # the jail's pid 1: no host paths


def test_expose_shows_the_config(home):
    with ScriptedServer([{"bash": f"cat {home}/home/.config/tmax/config.toml"}, {"bash": SUBMIT}],
                        api_key="sk-your-key") as srv:
        write_config(home, srv)
        rc, events, stderr = run_json(["--workdir", str(home / "ws"), "--expose", "~/.config/tmax", "go"],
                                      _env(home), home / "ws")
    assert rc == 0, stderr
    assert "sk-your-key" in next(e for e in events if e["type"] == "observation")["observation"]


def test_hard_link_to_a_masked_file_stops_the_start(home):
    with ScriptedServer([{"bash": "cat leak.toml"}, {"bash": SUBMIT}], api_key="sk-your-key") as srv:
        cfg = write_config(home, srv)
        os.link(cfg, home / "ws" / "leak.toml")
        rc, events, stderr = run_json(["--workdir", str(home / "ws"), "go"], _env(home), home / "ws")
        assert srv.requests == []  # nothing ran, nothing was shown
    assert rc == 7, stderr
    assert "hard links" in events[-1]["error"] and "leak" not in json.dumps(events[:-1])


def test_home_as_workspace_needs_yes(home):
    env = _env(home)
    with ScriptedServer([{"bash": SUBMIT}]) as srv:
        args = ["--base-url", srv.base_url, "--model", srv.model, "--workdir", str(home / "home"),
                "-o", str(home / "ws" / "run"), "go"]
        rc, events, stderr = run_json(args, env, home)
        assert rc == 2 and "whole home" in events[-1]["error"] and "--yes" in events[-1]["error"], stderr
        assert srv.requests == []
        rc, events, stderr = run_json(["--yes", *args], env, home)
        assert rc == 0, stderr
    rc, events, stderr = run_json(["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--workdir", "/", "go"], env, home)
    assert rc == 2 and "cannot make / its workspace" in events[-1]["error"], stderr


def test_home_as_workspace_asks_at_a_terminal(home):
    import pexpect

    args = ["-m", "tmax.cli.main", "run", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
            "--workdir", str(home / "home"), "go"]
    child = pexpect.spawn(sys.executable, args, env=_env(home), cwd=str(home), encoding="utf-8", timeout=60)
    child.expect("whole home directory")
    child.expect(r"Go on\? \[y/N\]")
    child.sendline("n")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2 and "start from a project directory" in child.before
