"""Settings for `tmax run`: flag > environment > config file > default, with clear errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tmax.cli import run_settings as config
from tmax.agents.agent_settings import AgentSettings
from tmax.common.errors import RenamedSettingWarning
from tmax.cli.run_settings import ConfigError, resolve_run_settings

ENV_VARS = ("TMAX_BASE_URL", "OPENAI_BASE_URL", "TMAX_API_KEY", "OPENAI_API_KEY", "TMAX_MODEL")


@pytest.fixture
def cfg_home(tmp_path, monkeypatch):
    """An empty XDG config home and no model/base-URL variables from the caller's shell."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "cfg"


def write_cfg(home: Path, text: str) -> Path:
    path = home / "tmax" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_paths_follow_xdg(cfg_home, tmp_path, monkeypatch):
    assert config.config_path() == cfg_home / "tmax" / "config.toml"
    run_dir = config.default_run_dir()
    assert run_dir.parent == tmp_path / "data" / "tmax" / "runs"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config.config_path() == tmp_path / "home" / ".config" / "tmax" / "config.toml"


def test_missing_base_url_names_every_source(cfg_home):
    with pytest.raises(ConfigError) as err:
        resolve_run_settings(sandbox="local")
    msg = str(err.value)
    for source in ("--base-url", "$TMAX_BASE_URL", "$OPENAI_BASE_URL", str(cfg_home / "tmax" / "config.toml")):
        assert source in msg


def test_precedence_flag_env_file(cfg_home, monkeypatch):
    path = write_cfg(cfg_home, 'base_url = "http://file:1/v1"\nmodel = "file-model"\napi_key = "file-key"\n')
    s = resolve_run_settings(sandbox="local")
    assert (s.base_url, s.model, s.api_key) == ("http://file:1/v1", "file-model", "file-key")
    assert s.sources["base_url"] == str(path)

    monkeypatch.setenv("OPENAI_BASE_URL", "http://openai-env:2/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    s = resolve_run_settings(sandbox="local")
    assert (s.base_url, s.api_key) == ("http://openai-env:2/v1", "env-key")
    assert s.sources["base_url"] == "$OPENAI_BASE_URL"

    # TMAX_BASE_URL beats OPENAI_BASE_URL, and the flag beats both.
    monkeypatch.setenv("TMAX_BASE_URL", "http://tmax-env:3/v1/")
    s = resolve_run_settings(sandbox="local")
    assert s.base_url == "http://tmax-env:3/v1"
    s = resolve_run_settings(base_url="http://flag:4/v1", model="flag-model", api_key="flag-key", sandbox="local")
    assert (s.base_url, s.model, s.api_key) == ("http://flag:4/v1", "flag-model", "flag-key")
    assert s.sources["model"] == "--model"


def test_defaults_mode_follows_sandbox(cfg_home):
    s = resolve_run_settings(base_url="http://x/v1", sandbox="local")
    # Compaction is on for people (the agent settings' default, which bench and learn keep, is off).
    assert (s.mode, s.api_key, s.image, s.agent) == ("confirm", "EMPTY", config.DEFAULT_IMAGE,
                                                     AgentSettings(compaction=True))
    assert s.sources["compaction"] == "default (tmax run)" and s.prices is None
    assert resolve_run_settings(base_url="http://x/v1", sandbox="podman").mode == "yolo"
    assert resolve_run_settings(base_url="http://x/v1", sandbox="bwrap").mode == "yolo"
    assert resolve_run_settings(base_url="http://x/v1", sandbox="local", mode="yolo").mode == "yolo"


def test_file_settings_for_sandbox_and_steps(cfg_home):
    write_cfg(cfg_home, 'base_url = "http://x/v1"\nsandbox = "podman"\nmode = "confirm"\nmax_steps = 7\nimage = "img:1"\n')
    s = resolve_run_settings()
    assert (s.sandbox, s.mode, s.agent.max_steps, s.image) == ("podman", "confirm", 7, "img:1")
    assert resolve_run_settings(sandbox="local", max_steps=3).agent.max_steps == 3


def test_compaction_and_prices_from_the_file_and_flags(cfg_home):
    write_cfg(cfg_home, 'base_url = "http://x/v1"\ncompaction = false\ncompaction_threshold = 0.6\nprice_input = 3.0\n')
    s = resolve_run_settings(sandbox="local")
    assert (s.agent.compaction, s.agent.compaction_threshold, s.prices) == (False, 0.6, (3.0, 0.0))
    s = resolve_run_settings(sandbox="local", compaction=True, compaction_threshold=0.7)
    assert (s.agent.compaction, s.agent.compaction_threshold) == (True, 0.7)
    assert s.sources["compaction_threshold"] == "--compact-threshold"
    with pytest.raises(ConfigError, match="compaction_threshold: Input should be less than 1, got 1.0"):
        resolve_run_settings(sandbox="local", compaction_threshold=1.0)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("base_url = ", "not valid TOML"),
        ('base_url = "http://x/v1"\nmodle = "typo"\n', "unknown key 'modle'"),
        ('base_url = "http://x/v1"\nmax_steps = "ten"\n', "max_steps: Input should be a valid integer, got str 'ten'"),
        ('base_url = "http://x/v1"\nmax_steps = true\n', "max_steps: Input should be a valid integer, got bool True"),
        ('base_url = "http://x/v1"\nsandbox = "docker"\n', "sandbox: Input should be 'local', 'bwrap' or 'podman'"),
        ('base_url = "http://x/v1"\ncommand_timeout = 0\n', "command_timeout: Input should be greater than 0"),
        ('base_url = "http://x/v1"\nmax_tokens = 0\n', "max_tokens: Input should be greater than or equal to 1"),
        ('base_url = "http://x/v1"\nexpose = "~/.ssh"\n', "expose: Input should be a valid list"),
        ('base_url = "localhost:8000"\n', "must start with http"),
    ],
)
def test_bad_config_file_is_a_clear_error(cfg_home, text, fragment):
    path = write_cfg(cfg_home, text)
    with pytest.raises(ConfigError) as err:
        resolve_run_settings()
    assert fragment in str(err.value)
    if "http" not in fragment:
        assert str(path) in str(err.value)


def test_missing_url_hint_names_a_key_the_file_accepts(cfg_home):
    with pytest.raises(ConfigError) as err:
        resolve_run_settings(sandbox="local")
    assert '`base_url = "..."`' in str(err.value)
    write_cfg(cfg_home, 'base_url = "http://x/v1"\n')
    assert resolve_run_settings(sandbox="local").base_url == "http://x/v1"


def test_timeouts_tokens_and_expose_from_flag_env_file(cfg_home, monkeypatch):
    s = resolve_run_settings(base_url="http://x/v1", sandbox="local")
    assert (s.agent.command_timeout, s.model_timeout, s.agent.max_tokens, s.expose) == (120.0, 600.0, 16384, [])
    write_cfg(cfg_home, 'base_url = "http://x/v1"\ncommand_timeout = 30\nmodel_timeout = 90.5\nmax_tokens = 2048\n'
                        'expose = ["~/.ssh"]\n')
    s = resolve_run_settings(sandbox="local", expose=["/etc/shadow"])
    assert (s.agent.command_timeout, s.model_timeout, s.agent.max_tokens, s.expose) == \
        (30.0, 90.5, 2048, ["~/.ssh", "/etc/shadow"])
    monkeypatch.setenv("TMAX_COMMAND_TIMEOUT", "7")
    monkeypatch.setenv("TMAX_MODEL_TIMEOUT", "8")
    s = resolve_run_settings(sandbox="local")
    assert (s.agent.command_timeout, s.model_timeout) == (7.0, 8.0)
    assert s.sources["command_timeout"] == "$TMAX_COMMAND_TIMEOUT"
    s = resolve_run_settings(sandbox="local", command_timeout=3, max_tokens=100)
    assert (s.agent.command_timeout, s.agent.max_tokens) == (3.0, 100)
    monkeypatch.setenv("TMAX_COMMAND_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="command_timeout: Input should be a valid number.*got 'soon' \\(from \\$TMAX_COMMAND_TIMEOUT\\)"):
        resolve_run_settings(sandbox="local")


def test_bad_flags(cfg_home):
    with pytest.raises(ConfigError, match="mode: Input should be 'confirm' or 'yolo', got 'auto' \\(from --mode\\)"):
        resolve_run_settings(base_url="http://x/v1", sandbox="local", mode="auto")
    with pytest.raises(ConfigError, match="max_steps: Input should be greater than or equal to 1, got 0 \\(from --max-steps\\)"):
        resolve_run_settings(base_url="http://x/v1", sandbox="local", max_steps=0)


def test_only_the_documented_variables_are_read(cfg_home, monkeypatch):
    """A stray $MODEL or $SANDBOX in someone's shell does not change a run: only the
    `TMAX_<KEY>` variables (and OPENAI_BASE_URL / OPENAI_API_KEY) are read."""
    for name, value in (("MODEL", "stray"), ("SANDBOX", "podman"), ("BASE_URL", "http://stray/v1"), ("MAX_STEPS", "1")):
        monkeypatch.setenv(name, value)
    s = resolve_run_settings(base_url="http://x/v1", sandbox="local")
    assert (s.model, s.sandbox, s.agent.max_steps, s.base_url) == (None, "local", 64, "http://x/v1")
    assert s.sources["sandbox"] == "--env" and s.sources["model"] == "default"
    monkeypatch.setenv("TMAX_MAX_STEPS", "7")
    s = resolve_run_settings(base_url="http://x/v1", sandbox="local")
    assert (s.agent.max_steps, s.sources["max_steps"]) == (7, "$TMAX_MAX_STEPS")


def test_default_sandbox_matches_bwrap_probe():
    expected = "bwrap" if config.bwrap_works() else "local"
    assert config.default_sandbox() == expected
    # The probe is real: where bwrap is installed it is actually executed.
    if config.shutil.which("bwrap") and config.bwrap_works():
        assert subprocess.run(["bwrap", "--ro-bind", "/", "/", "true"]).returncode == 0


def _tmax(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tmax.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_cli_reports_missing_base_url(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    proc = _tmax(["run", "--env", "local", "echo hi"], env)
    assert proc.returncode == 2
    for source in ("--base-url", "$TMAX_BASE_URL", "$OPENAI_BASE_URL", "config.toml"):
        assert source in proc.stderr
    # --json reports the same error as a JSON line on stdout.
    proc = _tmax(["run", "--json", "--env", "local", "echo hi"], env)
    assert proc.returncode == 2
    import json

    event = json.loads(proc.stdout.strip().splitlines()[-1])
    assert event["type"] == "error" and "--base-url" in event["error"]


def test_cli_bad_config_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    write_cfg(tmp_path / "cfg", 'base_url = "http://127.0.0.1:9/v1"\ncolour = "red"\n')
    proc = _tmax(["run", "--env", "local", "--model", "m", "echo hi"], env)
    assert proc.returncode == 2
    assert "unknown key 'colour'" in proc.stderr


def test_cli_model_discovery_failure_is_clear(tmp_path):
    # Nothing listens on port 9 (discard); no model was named, so listing models fails.
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    proc = _tmax(["run", "--env", "local", "--base-url", "http://127.0.0.1:9/v1", "echo hi"], env)
    assert proc.returncode == 2
    assert "no model given" in proc.stderr and "127.0.0.1:9" in proc.stderr
    for source in ("--model", "$TMAX_MODEL", "config.toml"):
        assert source in proc.stderr


def test_learner_strategy_reaches_the_learner():
    from tmax.training.config import ConfigError, preset
    from tmax.training.trainer import learner_config

    assert learner_config(preset("nano")).strategy == "fsdp"
    assert learner_config(preset("nano", {"run": {"learner_strategy": "replicate"}})).strategy == "replicate"
    with pytest.raises(ConfigError, match="learner_strategy"):
        preset("nano", {"run": {"learner_strategy": "zero3"}})


# ---- one agent-settings schema: run's file, bench's --ak and --config, learn's [rollout] ----


def test_run_config_file_takes_every_agent_setting(cfg_home):
    write_cfg(cfg_home, 'base_url = "http://x/v1"\ntemperature = 0.2\ntop_p = 0.5\ncontext_budget = 4000\n'
                        'backoff_s = [1, 2]\nbudget_hints = true\nobservation_max_chars = 500\n')
    s = resolve_run_settings(sandbox="local")
    assert s.agent == AgentSettings(temperature=0.2, top_p=0.5, context_budget=4000, backoff_s=(1.0, 2.0),
                                    budget_hints=True, observation_max_chars=500, compaction=True)
    assert s.sources["temperature"] == str(cfg_home / "tmax" / "config.toml") and s.sources["retries"] == "default"
    assert resolve_run_settings(sandbox="local", budget_hints=True).sources["budget_hints"] == "--budget-hints"


def test_run_config_file_old_names_load_with_a_note_or_fail_beside_the_new(cfg_home):
    path = write_cfg(cfg_home, 'base_url = "http://x/v1"\nmax_tool_calls = 5\nper_turn_max_tokens = 300\n')
    with pytest.warns(RenamedSettingWarning) as notes:
        s = resolve_run_settings(sandbox="local")
    assert "agent setting 'max_tool_calls' is now called 'max_steps'" in {str(n.message).split(";")[0] for n in notes}
    assert (s.agent.max_steps, s.agent.max_tokens, s.sources["max_steps"]) == (5, 300, str(path))
    write_cfg(cfg_home, 'base_url = "http://x/v1"\nmax_tool_calls = 5\nmax_steps = 6\n')
    with pytest.raises(ConfigError, match="'max_tool_calls' is the old name of 'max_steps': give only 'max_steps'"):
        resolve_run_settings(sandbox="local")


def test_learn_rollout_old_names_load_as_the_new_ones(tmp_path, monkeypatch):
    from tmax.training.config import dump_toml, load_config, resolve

    new = tmp_path / "new.toml"
    new.write_text('extends = "nano"\n[rollout]\nmax_steps = 3\nmax_tokens = 32\n')
    old = tmp_path / "old.toml"
    old.write_text('extends = "nano"\n[rollout]\nmax_tool_calls = 3\nper_turn_max_tokens = 32\n')
    with pytest.warns(RenamedSettingWarning) as notes:
        loaded = load_config(old)
    assert "agent setting 'per_turn_max_tokens' is now called 'max_tokens'" in {str(n.message).split(";")[0] for n in notes}
    assert loaded == load_config(new) and (loaded.rollout.max_steps, loaded.rollout.max_tokens) == (3, 32)
    assert "max_steps = 3" in dump_toml(loaded) and "max_tool_calls" not in dump_toml(loaded)
    # An old name over a preset (whose dump has the new one) is no conflict; both in one source are.
    with pytest.warns(RenamedSettingWarning):
        assert resolve("nano", environ={"TMAX_LEARN_ROLLOUT__MAX_TOOL_CALLS": "2"}).rollout.max_steps == 2
    both = tmp_path / "both.toml"
    both.write_text('extends = "nano"\n[rollout]\nmax_tool_calls = 3\nmax_steps = 4\n')
    with pytest.raises(ConfigError, match="rollout: 'max_tool_calls' is the old name of 'max_steps'"):
        load_config(both)


def test_one_schema_two_sets_of_defaults():
    """The shared keys have the same names everywhere; the training defaults differ from
    Vanillux2's only where `RolloutConfig` says so."""
    from tmax.cli.bench_settings import BenchSettings
    from tmax.cli.run_settings import RunFile
    from tmax.training.config import RolloutConfig

    keys = set(AgentSettings.model_fields)
    assert keys <= set(RolloutConfig.model_fields) and keys <= set(RunFile.model_fields)
    assert keys <= set(BenchSettings.model_fields)
    run, train = AgentSettings(), RolloutConfig().agent_only()
    differ = {k for k in keys if getattr(run, k) != getattr(train, k)}
    assert differ == {"temperature", "top_p", "max_format_errors", "context_budget", "retries", "backoff_s"}
    assert (run.temperature, run.max_format_errors, train.temperature, train.max_format_errors) == (0.7, 64, 1.0, 1)


def test_bench_agent_settings_map_old_names_and_reject_unknown_ones(tmp_path):
    from tmax.tasks.job import JobSpec

    base = dict(job_name="j", jobs_dir=str(tmp_path), dataset="d", agent="tmax")
    with pytest.warns(RenamedSettingWarning):
        cfg = JobSpec(**base, agent_kwargs={"max_tool_calls": 3, "temperature": 0.1})
    assert cfg.agent_kwargs == {"max_steps": 3, "temperature": 0.1}
    assert cfg.agent_settings == AgentSettings(max_steps=3, temperature=0.1)
    with pytest.raises(ValueError, match="give only 'max_steps'"):
        JobSpec(**base, agent_kwargs={"max_tool_calls": 3, "max_steps": 3})
    with pytest.raises(ValueError, match="unknown agent setting\\(s\\) 'temp'; known: backoff_s"):
        JobSpec(**base, agent_kwargs={"temp": 0.1})


def test_bench_config_file_is_validated_strictly(tmp_path):
    from tmax.cli.bench_settings import load_bench_file

    path = tmp_path / "bench.toml"
    path.write_text('dataset = "ds"\nagent = "tmax"\nn_attempts = 3\ninclude = ["a-*"]\nenv = "local"\n'
                    "max_steps = 8\ntemperature = 0\n")
    f = load_bench_file(path)
    assert f.model_dump(exclude_unset=True) == {"dataset": "ds", "agent": "tmax", "n_attempts": 3, "include": ["a-*"],
                                                "env": "local", "max_steps": 8, "temperature": 0.0}
    for text, fragment in (('n_attempts = "3"\n', "n_attempts: Input should be a valid integer"),
                           ("colour = 1\n", "unknown key(s) 'colour'; known: agent, api_key_env"),
                           ('env = "docker"\n', "env: Input should be 'local', 'bwrap' or 'podman'"),
                           ("max_steps = 0\n", "max_steps: Input should be greater than or equal to 1"),
                           ("n_attempts = \n", "not valid TOML")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
            load_bench_file(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    path.write_text("per_turn_max_tokens = 99\n")
    with pytest.warns(RenamedSettingWarning):
        assert load_bench_file(path).max_tokens == 99
