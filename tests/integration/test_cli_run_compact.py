"""Long `tmax run` sessions end to end: compaction (automatic and /compact), project
instructions (AGENTS.md, --instructions), the context and usage shown, `tmax show` and
`--export messages` of a compacted session, `--resume` after a compaction. The real CLI in a
pty (pexpect) and headless, real bash, a real HTTP model server replaying scripted turns
(its window: 8,000 tokens; the turns that cross the threshold say so in their usage)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from documented import documented
from scripted_server import ScriptedServer
from test_cli_run import FOLLOW_UP, SUBMIT, Tmax, env  # noqa: F401  (env: the clean-environment fixture)
from tmax.agents.compaction import summary_prompt

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 8000
BIG = "python3 -c \"print('a' * 4000)\""


def crossing(n: int, total: int) -> dict:
    """A turn whose context (prompt + completion) is `total` tokens: over the threshold."""
    return {"bash": f"echo step-{n}", "usage": {"prompt_tokens": total - 20, "completion_tokens": 20, "total_tokens": total}}


def carried(request: dict) -> str:
    """The user message a rebuilt context starts with (after the system prompt)."""
    return request["messages"][1]["content"]


def summary_calls(requests: list[dict]) -> list[int]:
    """The indices of the requests that asked for a summary."""
    return [i for i, r in enumerate(requests) if r["messages"][-1]["content"].startswith(summary_prompt(None)[:60])]


@pytest.fixture
def project(tmp_path):
    """A repository with AGENTS.md at its root and in the working directory, and a config
    file that runs on the host without asking (so the commands below are typed as the docs show them)."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "AGENTS.md").write_text("ROOT-RULE: use four spaces.\n")
    ws = repo / "ws"
    ws.mkdir()
    (ws / "AGENTS.md").write_text("WS-RULE: run make test before you submit.\n")
    (tmp_path / "cfg" / "tmax").mkdir(parents=True)
    (tmp_path / "cfg" / "tmax" / "config.toml").write_text(
        'sandbox = "local"\nmode = "yolo"\nprice_input = 3.0\nprice_output = 15.0\n')
    return ws


def run_dir_of(tmp_path: Path) -> Path:
    (found,) = (tmp_path / "data" / "tmax" / "runs").iterdir()
    return found


def test_two_compactions_with_follow_ups_then_compact_and_usage_in_a_pty(env, project, tmp_path):
    script = [{"bash": BIG}, {"bash": "echo step-2"}, crossing(3, 6000), {"content": "SUMMARY-ONE: printed a's."},
              {"bash": SUBMIT},
              {"bash": "echo step-6"}, crossing(7, 6100), {"content": "SUMMARY-TWO: the flag is in."}, {"bash": SUBMIT},
              {"content": "SUMMARY-THREE: tests next."}, {"bash": SUBMIT}]
    with ScriptedServer(script, max_model_len=WINDOW) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        t = Tmax(documented('tmax run "add a --verbose flag" --compact-threshold 0.7')[2:], env, project)
        try:
            t.expect("Context compacted \\(automatic")
            t.answer(FOLLOW_UP, "follow-up BETA: also document it")
            t.expect("compaction 2")
            t.answer(FOLLOW_UP, "/usage")
            t.expect("compactions so far: 2")
            t.answer(FOLLOW_UP, "/compact keep the flag's tests in focus")
            t.expect("compaction 3")
            t.answer(FOLLOW_UP, "follow-up GAMMA: add a test")
            t.answer(FOLLOW_UP, "")
            assert t.finish() == 0
        finally:
            t.kill()
        requests = srv.requests
    screen = " ".join(t.screen.split())
    task = requests[0]["messages"][1]["content"]
    assert "add a --verbose flag" in task
    # The project's instructions: listed at the start, in the system prompt root first.
    system = requests[0]["messages"][0]["content"]
    assert system.index("ROOT-RULE: use four spaces.") < system.index("WS-RULE: run make test")
    assert f"project instructions: {project.parent / 'AGENTS.md'}, {project / 'AGENTS.md'}" in screen
    assert "compaction at 70% of the context window" in screen
    # Tokens used and left after every turn, in the server's window.
    assert f"context 6000 of {WINDOW} (2000 left)" in screen and f"context 6100 of {WINDOW} (1900 left)" in screen
    assert summary_calls(requests) == [3, 7, 9]
    assert requests[9]["messages"][-1]["content"].endswith("keep this in focus: keep the flag's tests in focus")
    # After each compaction the task, and every follow-up typed before it, word for word.
    for after, summary, follow_ups in ((4, "SUMMARY-ONE", []), (8, "SUMMARY-TWO", ["follow-up BETA: also document it"]),
                                       (10, "SUMMARY-THREE", ["follow-up BETA: also document it"])):
        text = carried(requests[after])
        assert text.startswith(task) and summary in text and all(f in text for f in follow_ups)
        assert requests[after]["messages"][0]["content"] == system
        assert "a" * 4000 not in json.dumps(requests[after]["messages"])
    assert requests[10]["messages"][-1]["content"] == "follow-up GAMMA: add a test"
    assert "Context compacted (on request" in screen and "usage" in screen
    # The cost at the configured prices ($3 / $15 per million tokens), after every turn and in /usage.
    assert "· $0.0" in screen and "· cost $0.0" in screen

    run = run_dir_of(tmp_path)
    usage = json.loads((run / "usage.json").read_text())
    assert usage["compactions"] == 3 and usage["context_window"] == WINDOW
    assert [s["path"] for s in json.loads((run / "run.json").read_text())["instructions"]] == [
        str(project.parent / "AGENTS.md"), str(project / "AGENTS.md")]
    # `tmax show` renders the whole session, each compaction where it happened, each step once.
    show = subprocess.run([sys.executable, "-m", "tmax.cli.main", "show", str(run)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)
    out = " ".join(show.stdout.split())
    assert show.returncode == 0, show.stderr
    assert out.index("step-2") < out.index("compaction 1") < out.index("step-6") < out.index("compaction 2")
    assert out.count("echo step-6") == 1 and "submitted · 8 steps · 3 compactions" in out
    # --export messages: one conversation per context, each as the model saw it.
    export = subprocess.run([sys.executable, "-m", "tmax.cli.main", "show", str(run), "--export", "messages"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    lines = [json.loads(line) for line in export.stdout.splitlines()]
    assert len(lines) == 4 and all(line["messages"][0]["content"] == system for line in lines)
    assert "a" * 4000 in json.dumps(lines[0]) and "SUMMARY-ONE" in lines[1]["messages"][1]["content"]


def tmax_json(args: list[str], env: dict, cwd: Path) -> tuple[int, list[dict]]:
    proc = subprocess.run([sys.executable, "-m", "tmax.cli.main", "run", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120, stdin=subprocess.DEVNULL)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def test_json_compaction_events_and_resume_after_a_compaction(env, project, tmp_path):
    (project / "NOTES.md").write_text("NOTES-RULE: keep the changelog.\n")
    first = [{"bash": BIG}, dict(crossing(2, 6500), usage={"prompt_tokens": 6480, "completion_tokens": 20,
                                                           "total_tokens": 6500, "cost": 0.25}),
             {"content": "SUMMARY-ONE."}, {"bash": SUBMIT}]
    second = [{"bash": "echo step-5"}, crossing(6, 6600), {"content": "SUMMARY-TWO."}, {"bash": SUBMIT}]
    with ScriptedServer(first + second, max_model_len=WINDOW) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        code, events = tmax_json(documented('tmax run --json "add a --verbose flag" --instructions NOTES.md')[2:], env,
                                 project)
        assert code == 0, events[-1]
        run = run_dir_of(tmp_path)
        code2, resumed = tmax_json(["--json", "--resume", str(run), "-o", str(tmp_path / "again"),
                                    "follow-up BETA"], env, project)
        requests = srv.requests
    assert code2 == 0, resumed[-1]
    start = events[0]
    assert start["compaction_threshold"] == 0.8
    assert start["instructions"] == [str(project.parent / "AGENTS.md"), str(project / "AGENTS.md"),
                                     str(project / "NOTES.md")]
    assert "NOTES-RULE" in requests[0]["messages"][0]["content"]
    # The cost the server reported for a turn, the configured prices for the others.
    cost = events[-1]["usage"]["cost_usd"]
    assert 0.25 < cost < 0.5 and json.loads((run / "usage.json").read_text())["cost_usd"] == pytest.approx(cost)
    model = next(e for e in events if e["type"] == "model")
    assert model["context"]["window"] == WINDOW and model["context"]["left"] == WINDOW - model["context"]["used"]
    for evs, summary in ((events, "SUMMARY-ONE."), (resumed, "SUMMARY-TWO.")):
        (c,) = [e for e in evs if e["type"] == "compaction"]
        assert c["ok"] and c["reason"] == "auto" and c["summary"] == summary and c["window"] == WINDOW
        assert c["tokens_before"] > 0.8 * WINDOW and 0 < c["tokens_after"] < c["tokens_before"]
    assert summary_calls(requests) == [2, 6]
    task = requests[0]["messages"][1]["content"]
    # The resumed session continues from the compacted context; its follow-up is carried next.
    assert carried(requests[4]).startswith(task) and "SUMMARY-ONE." in carried(requests[4])
    assert carried(requests[7]).startswith(task) and "follow-up BETA" in carried(requests[7])
    assert "SUMMARY-TWO." in carried(requests[7]) and requests[7]["messages"][0] == requests[0]["messages"][0]


def test_a_failed_summary_is_said_and_the_session_goes_on(env, project, tmp_path):
    script = [crossing(1, 7000), {"error": "bad_request"}, {"bash": SUBMIT}]
    with ScriptedServer(script, max_model_len=WINDOW) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        code, events = tmax_json(["--json", "--no-instructions", "go"], env, project)
        requests = srv.requests
    assert code == 0 and events[0]["instructions"] == []
    (c,) = [e for e in events if e["type"] == "compaction"]
    assert not c["ok"] and "the summary call failed" in c["error"] and c["tokens_after"] is None
    assert requests[2]["messages"][:4] == requests[1]["messages"][:4]  # nothing was replaced
    assert "ROOT-RULE" not in requests[0]["messages"][0]["content"]


@pytest.mark.parametrize("args, message", [
    (["--compact-threshold", "1.5"], "compaction_threshold: Input should be less than 1, got 1.5 (from --compact-threshold)"),
    (["--compact-threshold", "0"], "compaction_threshold: Input should be greater than 0"),
    (["--instructions", "missing.md"], "cannot read the instructions file /"),
    (["--instructions", "x.md", "--no-instructions"], "--instructions FILE and --no-instructions contradict"),
])
def test_bad_threshold_or_instructions_file_is_one_line_and_exit_2(env, project, args, message):
    env["TMAX_BASE_URL"] = "http://127.0.0.1:9/v1"
    proc = subprocess.run([sys.executable, "-m", "tmax.cli.main", "run", "--json", "go", *args], capture_output=True,
                          text=True, cwd=project, env=env, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
