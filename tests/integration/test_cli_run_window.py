"""`tmax run` never ends at the context window: sessions many times longer than a 4,096-token
window against a model server that enforces it on every request (the summary calls too), as
vLLM does: its window listed by /v1/models and its usage reported as vLLM reports it, or no
usage, or a window it does not list (its 400 "maximum context length" the only sign of it).
The real CLI in a pty (pexpect) and with --json, real bash, AGENTS.md in the repository.
In each: exit 0, compactions that succeed, and the task and every follow-up verbatim in every
request the server got. The same against the nano model served by vLLM: test_run_tokens.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from scripted_server import ScriptedServer, prompt_length
from test_cli_run import FOLLOW_UP, SUBMIT, Tmax, env  # noqa: F401  (env: the clean-environment fixture)
from tmax.agents.compaction import summary_prompt

WINDOW = 4096
TASK = "add a --verbose flag to the CLI"
SUMMARY_START = summary_prompt(None)[:60]


def printing(chars: int) -> str:
    return f"python3 -c \"print('x' * {chars})\""


class Model:
    """A scripted model for a long session: `actions` are output sizes in characters (a
    command printing that many) or "SUBMIT"; a summary request gets a summary."""

    def __init__(self, actions: list) -> None:
        self.actions = list(actions)
        self.done = 0
        self.summaries = 0
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> dict:
        last = body["messages"][-1]
        with self.lock:
            if last["role"] == "user" and str(last["content"]).startswith(SUMMARY_START):
                self.summaries += 1
                return {"content": f"SUMMARY-{self.summaries}: printed x's; the flag is not added yet."}
            action = self.actions[self.done] if self.done < len(self.actions) else "SUBMIT"
            self.done += 1
        return {"bash": SUBMIT if action == "SUBMIT" else printing(action)}


def sizes(n: int, low: float, high: float, seed: int = 0) -> list[int]:
    """`n` output sizes, each between `low` and `high` of the window (at ~4 characters a token)."""
    rng = random.Random(seed)
    return [int(rng.uniform(low, high) * WINDOW * 4) for _ in range(n)]


def text_of(request: dict) -> str:
    return "\n".join(str(m.get("content")) for m in request["messages"])


def assert_verbatim_everywhere(requests: list[dict], follow_ups: list[str]) -> None:
    """The task in every request; each follow-up in every request from the first that has it on."""
    assert requests
    seen: set[str] = set()
    for i, request in enumerate(requests):
        text = text_of(request)
        assert TASK in text, f"request {i} lacks the task"
        seen |= {f for f in follow_ups if f in text}
        assert all(f in text for f in seen), f"request {i} lacks a follow-up"
    assert seen == set(follow_ups)


@pytest.fixture
def project(tmp_path):
    """A repository with AGENTS.md, and a config that runs on the host without asking."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "AGENTS.md").write_text("RULE: run the tests before you submit. Keep functions short.\n" * 4)
    (tmp_path / "cfg" / "tmax").mkdir(parents=True)
    (tmp_path / "cfg" / "tmax" / "config.toml").write_text('sandbox = "local"\nmode = "yolo"\n')
    return repo


def tmax_json(args: list[str], env: dict, cwd: Path) -> tuple[int, list[dict], str]:
    proc = subprocess.run([sys.executable, "-m", "tmax.cli.main", "run", "--json", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600, stdin=subprocess.DEVNULL)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


def run_dir_of(tmp_path: Path) -> Path:
    (found,) = (tmp_path / "data" / "tmax" / "runs").iterdir()
    return found


def compactions(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "compaction"]


def test_the_issue_case_five_thousand_character_outputs_never_overflow(env, project):
    """The case reported: a 4,096-token window, AGENTS.md, commands printing ~5,000 characters,
    usage reported. Each request is counted before it goes out: none is refused."""
    model = Model([5000] * 8)
    with ScriptedServer(model, max_model_len=WINDOW) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        code, events, stderr = tmax_json([TASK], env, project)
        requests, refused = srv.requests, srv.refused
    assert code == 0 and events[-1]["status"] == "submitted", (events[-1], stderr[-2000:])
    done = compactions(events)
    assert len(done) >= 2 and all(c["ok"] and c["reason"] == "auto" for c in done)
    assert refused == [] and all(prompt_length(r) <= WINDOW for r in requests)
    # Before each compaction: a line saying so (--json: a compaction_start event) with its size.
    starts = [e for e in events if e["type"] == "compaction_start"]
    assert len(starts) == len(done) and all(s["window"] == WINDOW for s in starts)
    for c in done:
        assert c["tokens_before"] >= 0.8 * WINDOW > c["tokens_after"] and {"clipped", "pieces"} <= c.keys()
    assert_verbatim_everywhere(requests, [])


@pytest.mark.parametrize("publish_window, report_usage", [(True, True), (True, False), (False, True)],
                         ids=["usage", "no-usage", "unlisted-window"])
def test_thirty_commands_of_ten_to_sixty_percent_of_the_window_then_resume(env, project, tmp_path,
                                                                          publish_window, report_usage):
    model = Model([*sizes(30, 0.1, 0.6), "SUBMIT", *sizes(6, 0.1, 0.6, seed=1)])
    with ScriptedServer(model, max_model_len=WINDOW, publish_window=publish_window,
                        report_usage=report_usage) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        code, events, stderr = tmax_json([TASK], env, project)
        assert code == 0, (events[-1], stderr[-2000:])
        run = run_dir_of(tmp_path)
        follow_up = "follow-up BETA: document the flag in README.md"
        code2, resumed, stderr2 = tmax_json(["--resume", str(run), "-o", str(tmp_path / "again"), follow_up],
                                            env, project)
        requests, refused = srv.requests, srv.refused
    assert code2 == 0, (resumed[-1], stderr2[-2000:])
    done = compactions(events)
    assert len(done) >= 3 and all(c["ok"] for c in done), done
    assert events[-1]["steps"] == 31 and compactions(resumed)
    if publish_window:  # counted before sending: the server never refuses a request
        assert refused == []
    else:  # its first 400 tells the window; that turn is compacted and tried again
        assert refused and done[0]["reason"] == "overflow" and done[0]["window"] == WINDOW
        assert len(refused) <= len(done)
    assert all(prompt_length(requests[i]) <= WINDOW for i in range(len(requests)) if i not in refused)
    assert_verbatim_everywhere(requests, [follow_up])


def test_one_output_twice_the_window_is_cut_and_the_session_goes_on(env, project, tmp_path):
    model = Model([WINDOW * 8, 2000])
    with ScriptedServer(model, max_model_len=WINDOW) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        code, events, stderr = tmax_json([TASK], env, project)
        requests, refused = srv.requests, srv.refused
    assert code == 0, (events[-1], stderr[-2000:])
    (big,) = [e for e in events if e["type"] == "observation" and e["clipped"]]
    assert big["step"] == 1 and big["clipped"]["chars"] == WINDOW * 8 + 1 and big["clipped"]["kept"] < WINDOW * 2
    whole = Path(big["clipped"]["file"])
    assert whole == run_dir_of(tmp_path) / "outputs" / "step-1.txt" and whole.read_text() == "x" * WINDOW * 8 + "\n"
    # The model is told it was cut, where the whole of it is, and gets its head and tail.
    assert "more than fits the context window" in big["observation"] and "outputs/step-1.txt" in big["observation"]
    assert refused == [] and all(prompt_length(r) <= WINDOW for r in requests)
    assert "x" * WINDOW * 2 not in text_of(requests[1]) and "x" * 200 in text_of(requests[1])
    assert_verbatim_everywhere(requests, [])


@pytest.mark.parametrize("publish_window, report_usage", [(True, True), (True, False), (False, True)],
                         ids=["usage", "no-usage", "unlisted-window"])
def test_a_long_session_in_a_pty_with_follow_ups_and_compact(env, project, tmp_path, publish_window, report_usage):
    model = Model([*sizes(12, 0.1, 0.6), "SUBMIT", *sizes(10, 0.1, 0.6, seed=2), "SUBMIT", WINDOW * 8, "SUBMIT"])
    follow_ups = ["follow-up BETA: also document it", "follow-up GAMMA: print the big log"]
    with ScriptedServer(model, max_model_len=WINDOW, publish_window=publish_window,
                        report_usage=report_usage) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        t = Tmax([TASK], env, project, timeout=120)
        try:
            t.expect("Compacting the context")
            t.answer(FOLLOW_UP, follow_ups[0])
            t.answer(FOLLOW_UP, "/compact keep the flag's name in focus")
            t.expect("compaction \\d+")
            t.answer(FOLLOW_UP, follow_ups[1])
            t.expect("more than fits the context window")
            t.answer(FOLLOW_UP, "")
            assert t.finish() == 0
        finally:
            t.kill()
        requests, refused = srv.requests, srv.refused
    screen = " ".join(t.screen.split())
    assert screen.count("Context compacted (automatic") >= 2 and "Context compacted (on request" in screen
    assert "The output of step" in screen and "outputs/step-" in screen
    # An unlisted window: the server's first 400 tells it (that turn compacted and tried again).
    assert len(refused) == (0 if publish_window else 1), refused
    assert all(prompt_length(requests[i]) <= WINDOW for i in range(len(requests)) if i not in refused)
    assert_verbatim_everywhere(requests, follow_ups)


def test_bench_with_compaction_on_keeps_a_trial_inside_the_window(tmp_path):
    """`tmax bench run ... --ak compaction=true`: a trial whose commands print half a window
    each is compacted before each request that would not fit, and still solves its task
    (a nano task, its oracle's commands after the long outputs, on the host)."""
    from tmax.training.nano.tasks import oracle_commands, write_splits

    write_splits(tmp_path / "nano", 0, 1, seed=3)
    (task_dir,) = sorted((tmp_path / "nano" / "heldout").iterdir())
    instruction = (task_dir / "instruction.md").read_text().strip()
    *solve, submit = oracle_commands(task_dir)
    turns = [{"bash": printing(WINDOW * 2)} for _ in range(8)] + [{"bash": " && ".join(solve)}, {"bash": submit}]

    def model(body: dict) -> dict:
        if str(body["messages"][-1]["content"]).startswith(SUMMARY_START):
            return {"content": "SUMMARY: printed x's; the task is not done yet."}
        return turns.pop(0) if turns else {"bash": submit}

    with ScriptedServer(model, max_model_len=WINDOW) as srv:
        proc = subprocess.run([sys.executable, "-m", "tmax.cli.main", "bench", "run", str(task_dir), "-a", "tmax",
                               "-m", srv.model, "--base-url", srv.base_url, "-e", "local", "--ak", "compaction=true",
                               "-o", str(tmp_path / "jobs"), "--job-name", "compact"],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        requests, refused = srv.requests, srv.refused
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trial,) = [d for d in (tmp_path / "jobs" / "compact").iterdir() if d.is_dir()]
    result = json.loads((trial / "result.json").read_text())
    assert result["tmax"]["outcome"] == "pass", result["exception_info"]
    summaries = [r for r in requests if str(r["messages"][-1]["content"]).startswith(SUMMARY_START)]
    assert len(summaries) >= 2 and refused == [] and all(prompt_length(r) <= WINDOW for r in requests)
    assert all(instruction in text_of(r) for r in requests)


@pytest.mark.parametrize("part", ["task", "system prompt"])
def test_only_a_system_prompt_and_task_over_the_window_end_the_run_saying_which(env, project, part):
    """Exit 4 only where no compaction can help: the task, or the system prompt with the
    project's instructions (AGENTS.md, at most 16,000 characters), alone over the window.
    The request goes out (an estimate ends nothing): the server refuses it, and nothing can shrink it."""
    task = TASK
    if part == "task":
        task = f"{TASK}: " + "make it so. " * 1600
    else:
        (project / "AGENTS.md").write_text("RULE: keep every line short and every test green. " * 320)
    with ScriptedServer(Model([]), max_model_len=WINDOW) as srv:
        env["TMAX_BASE_URL"] = srv.base_url
        code, events, _ = tmax_json([task], env, project)
        requests, refused = srv.requests, srv.refused
    assert code == 4 and events[-1]["status"] == "context_overflow" and refused == [0] and len(requests) == 1
    error = events[-1]["error"]
    assert f"cannot be made to fit the model's {WINDOW:,}-token window" in error, error
    assert error.endswith(f"The largest part is the {part}: shorten it"), error
