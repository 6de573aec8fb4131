"""Budget hints: off by default (observations exact), on: steps/time/context left and a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from scripted_server import ScriptedServer

from tmax.agents.budget import WARNING_TEXT, Budget, budget_hint
from tmax.agents.chat_policy import ChatPolicy
from tmax.agents.loop import Agent
from tmax.agents.agent_settings import AgentSettings
from tmax.agents.prompts import SUBMIT_MARKER
from tmax.sandbox import SandboxSpec, make_sandbox


def test_hint_text_and_warning_thresholds():
    early = budget_hint(Budget(64, 2, 65536, 1000, 5.0, time_budget_s=900.0))
    assert early == "\n\n[budget: 62 of 64 steps left · 14m55s of 15m00s left · 64.5k of 65.5k context tokens left]"
    assert WARNING_TEXT not in early
    assert WARNING_TEXT in budget_hint(Budget(64, 61, 65536, 1000, 5.0))  # 3 steps left
    assert WARNING_TEXT in budget_hint(Budget(64, 2, 65536, 60000, 5.0))  # context nearly full
    assert WARNING_TEXT in budget_hint(Budget(64, 2, 65536, 1000, 850.0, time_budget_s=900.0))
    assert "elapsed, no time limit" in budget_hint(Budget(10, 1, 100, 0, 61.0))


def _observations(tmp_path, **cfg) -> list[str]:
    script = [
        {"bash": "echo one", "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}},
        {"bash": "echo two", "usage": {"prompt_tokens": 200, "completion_tokens": 10, "total_tokens": 210}},
        {"bash": f"echo {SUBMIT_MARKER}"},
    ]
    box = make_sandbox("local", SandboxSpec(workdir=str(tmp_path)))
    box.start()
    try:
        with ScriptedServer(script) as srv:
            policy = ChatPolicy(model=srv.model, base_url=srv.base_url)
            result = Agent(policy, box, AgentSettings(max_steps=4, context_budget=1000, **cfg)).run("count")
    finally:
        box.close()
    assert result.status == "submitted"
    return [m["content"] for m in result.messages if m["role"] == "tool"]


def test_off_by_default_observations_are_exact(tmp_path):
    assert _observations(tmp_path)[:2] == ["one\n\n(exit_code=0)", "two\n\n(exit_code=0)"]


def test_on_appends_budget_and_warns_near_the_end(tmp_path):
    first, second, _ = _observations(tmp_path, budget_hints=True, time_budget_s=600.0)
    assert first.startswith("one\n\n(exit_code=0)\n\n[budget: 3 of 4 steps left · ")
    assert "890 of 1000 context tokens left]" in first and WARNING_TEXT not in first
    assert "2 of 4 steps left" in second and "790 of 1000 context tokens left" in second
    assert WARNING_TEXT not in second  # with 4 steps the warning starts at the last one


def test_learn_and_bench_configs_switch_it_on():
    from tmax.tasks.runners import TmaxAgent
    from tmax.training.config import RolloutConfig
    from tmax.training.rollout import EpisodeSettings

    assert EpisodeSettings.of(RolloutConfig()).agent.budget_hints is False
    assert EpisodeSettings.of(RolloutConfig(budget_hints=True)).agent.budget_hints is True
    # The held-out bench trials of the recipe take the rollout section's settings too.
    assert RolloutConfig(budget_hints=True).agent_only().budget_hints is True
    assert TmaxAgent("m", "http://x", settings=AgentSettings(budget_hints=True)).settings.budget_hints is True


def test_run_flag_appends_hints(tmp_path):
    with ScriptedServer([{"bash": "echo hi"}, {"bash": f"echo {SUBMIT_MARKER}"}]) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "tmax.cli.main", "run", "--json", "--budget-hints", "--env", "local", "--workdir", str(tmp_path),
             "--base-url", srv.base_url, "--model", srv.model, "--max-steps", "5", "-o", str(tmp_path / "run"), "go"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=Path(__file__).parents[2],
            env={**{k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))},
                 "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_DATA_HOME": str(tmp_path / "data")})
    observations = [json.loads(line)["observation"] for line in proc.stdout.splitlines() if '"observation"' in line]
    assert proc.returncode == 0, proc.stderr
    assert observations[0].startswith("hi\n\n(exit_code=0)\n\n[budget: 4 of 5 steps left · ")
    assert "elapsed, no time limit" in observations[0]


def test_bench_agent_kwargs_are_agent_settings(tmp_path):
    """`--ak` sets `AgentSettings` fields; a name it does not have is a clear error before any
    trial runs, not a setting silently dropped."""
    from typer.testing import CliRunner

    from tmax.cli.main import app

    task = Path(__file__).parents[1] / "data" / "tasks" / "echo-hello"
    r = CliRunner().invoke(app, ["bench", "run", str(task), "-a", "tmax", "-m", "m", "--base-url", "http://127.0.0.1:9/v1",
                                 "--ak", "max_step=3", "-o", str(tmp_path / "jobs")])
    assert r.exit_code == 2, r.output
    assert "unknown agent setting(s) 'max_step'" in r.output and "max_steps" in r.output
    assert not (tmp_path / "jobs").exists()
