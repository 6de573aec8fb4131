"""The settings' one declaration (`common.settings`) and the flags made from it
(`cli.options`): options after any subcommand, one spelling per idea with the old ones as
hidden aliases, `--print-config` naming where each value came from."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from tmax.cli.main import app
from tmax.common.settings import (Env, describe, env_layer, flag, flag_specs, leaf_fields, resolve_layers,
                                  settings_table)


def tmax(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def shown(result, section: str, key: str) -> str:
    """`key = value  # source` of a --print-config listing, in `section` ('' for the top)."""
    text = result.stdout if not section else result.stdout.split(f"[{section}]\n", 1)[1].split("\n[", 1)[0]
    return next(line for line in text.splitlines() if line.startswith(f"{key} = "))


def test_learn_options_after_the_subcommand_as_the_docs_type_them(tmp_path):
    out = tmp_path / "x"
    r = tmax("learn", "nano", "-c", "nano-podman", "-o", str(out), "--seed", "1", "--steps", "2", "--print-config")
    assert r.exit_code == 0, r.output
    assert shown(r, "", "name") == 'name = "nano-podman"  # preset nano-podman'
    assert shown(r, "algo", "seed") == "seed = 1  # --seed"
    assert shown(r, "algo", "steps") == "steps = 2  # --steps"
    assert shown(r, "run", "out_dir") == f'out_dir = "{out}"  # --out'
    assert shown(r, "rollout", "sandbox") == 'sandbox = "podman"  # preset nano-podman'
    for sub in ("sft", "nano"):  # before the subcommand too, and the subcommand's own win
        r = tmax("learn", "-c", "nano-podman", "--seed", "5", sub, "--seed", "6", "--print-config")
        assert r.exit_code == 0, r.output
        assert shown(r, "", "name").startswith('name = "nano-podman"') and shown(r, "algo", "seed").startswith("seed = 6")
    r = tmax("learn", "--print-config", "-c", "nano-lora", "nano", "--steps", "3")
    assert r.exit_code == 0 and shown(r, "algo", "steps") == "steps = 3  # --steps", r.output
    assert shown(r, "algo", "warmup_steps").endswith("# preset nano")  # nano-lora extends nano


def test_lora_rank_after_nano_and_the_environment_under_the_flags(tmp_path):
    env = {"TMAX_LEARN_ALGO__STEPS": "7", "TMAX_LEARN_LORA__RANK": "4"}
    r = tmax("learn", "nano", "--lora-rank", "8", "-o", str(tmp_path), "--print-config", env=env)
    assert r.exit_code == 0, r.output
    assert shown(r, "lora", "rank") == "rank = 8  # --lora-rank"
    assert shown(r, "algo", "steps") == "steps = 7  # $TMAX_LEARN_ALGO__STEPS"


def test_the_old_sandbox_spelling_still_works_with_a_note():
    r = tmax("learn", "nano", "--sandbox", "local", "--print-config")
    assert r.exit_code == 0, r.output
    assert "note: --sandbox is now --env" in r.stderr
    assert shown(r, "rollout", "sandbox") == shown(r, "eval", "sandbox") == 'sandbox = "local"  # --sandbox'
    r = tmax("learn", "nano", "-e", "bwrap", "--print-config")
    assert "note" not in r.stderr and shown(r, "eval", "sandbox") == 'sandbox = "bwrap"  # --env'


def test_data_generate_takes_its_flags_and_defaults_from_its_config(tmp_path):
    """`tmax data generate`'s flags are `GenerateConfig`'s: their help is the fields'
    descriptions with the declared defaults, a missing one names its flag, and
    --print-config says where each value came from ($TMAX_BASE_URL included)."""
    from tmax.tasks.corpus.generate_config import GenerateConfig

    r = tmax("data", "generate", "--help")
    assert r.exit_code == 0, r.output
    help_text = " ".join(r.stdout.replace("│", " ").split())
    assert "Tasks generated and gated at once. Default: 4." in help_text
    assert "Tasks to keep. Required." in help_text and "PydanticUndefined" not in help_text
    r = tmax("data", "generate", "-N", "2", "-m", "m", "--base-url", "http://h/v1")
    assert r.exit_code == 2 and "--out/-o is required" in r.output
    r = tmax("data", "generate", "-o", str(tmp_path / "c"), "-N", "2", "-m", "m", "-n", "3", "--print-config",
             env={"TMAX_BASE_URL": "http://h/v1", "TMAX_DATA_GENERATE_MAX_RETRIES": "5"})
    assert r.exit_code == 0, r.output
    assert shown(r, "", "base_url") == 'base_url = "http://h/v1"  # $TMAX_BASE_URL'
    assert shown(r, "", "n_concurrent") == "n_concurrent = 3  # --n-concurrent"
    assert shown(r, "", "max_retries") == "max_retries = 5  # $TMAX_DATA_GENERATE_MAX_RETRIES"
    declared = GenerateConfig.model_fields["max_redraws"].default
    assert shown(r, "", "max_redraws") == f"max_redraws = {declared}  # default"


def test_bad_values_name_the_flag_or_the_preset():
    r = tmax("learn", "nano", "-e", "docker", "--print-config")
    assert r.exit_code == 2 and "docker" in r.output
    r = tmax("learn", "nano", "-c", "nano-podmn", "--print-config")
    assert r.exit_code == 2 and "unknown preset 'nano-podmn'" in r.output


def test_every_command_spells_where_episodes_run_the_same_way():
    for words in (["run"], ["bench", "run"], ["bench", "terminal-bench"], ["bench", "resume"], ["learn"],
                  ["learn", "nano"], ["learn", "sft"], ["data", "validate"], ["data", "generate"], ["data", "solve"]):
        r = tmax(*words, "--help")
        assert r.exit_code == 0, (words, r.output)
        assert "--env" in r.stdout and "--sandbox " not in r.stdout, words


def test_every_command_spells_the_output_directory_the_same_way(tmp_path):
    for words in (["run"], ["learn"], ["learn", "nano"], ["learn", "sft"], ["data", "generate"], ["data", "import"],
                  ["data", "combine"]):
        r = tmax(*words, "--help")
        assert r.exit_code == 0, (words, r.output)
        assert "--out " in r.stdout and "-o " in r.stdout and "--output " not in r.stdout, words
    r = tmax("run", "--output", str(tmp_path / "x"), "-e", "local", "--print-config", "a task",
             env={"XDG_CONFIG_HOME": str(tmp_path), "TMAX_BASE_URL": "", "OPENAI_BASE_URL": ""})
    assert r.exit_code == 0 and "note: --output is now --out" in r.stderr, r.output


class _Inner(BaseModel):
    depth: Annotated[int, Field(ge=0, description="How deep."), flag("--depth", "-d", old=("--deep",))] = 3


class _Outer(BaseModel):
    url: Annotated[str | None, Field(description="Where."), Env(("OTHER_URL",))] = None
    inner: _Inner = Field(default_factory=_Inner)
    also: Annotated[int, Field(description="Same flag."), flag("--depth", "-d")] = 1


def test_one_declaration_gives_flags_env_names_sources_and_the_table():
    specs = flag_specs(_Outer, "x")
    assert [(s.name, s.paths) for s in specs] == [("--depth", (("inner", "depth"), ("also",)))]
    assert specs[0].help() == "How deep. Default: 3." and specs[0].help(False) == "How deep."
    env, labels = env_layer(_Outer, "T_", {"OTHER_URL": "http://o", "T_INNER__DEPTH": "5", "T_NOPE": "1"})
    assert env == {"url": "http://o", "inner": {"depth": 5}} and labels["url"] == "$OTHER_URL"
    assert env_layer(_Outer, "T_", {"T_URL": "http://t", "OTHER_URL": "http://o"})[0] == {"url": "http://t"}
    data, sources = resolve_layers([({"inner": {"depth": 1}}, "file.toml"), (env, labels),
                                    ({"also": 9}, {"also": "--depth"})])
    model = _Outer.model_validate(data)
    assert describe(model, sources) == ['url = "http://o"  # $OTHER_URL', 'also = 9  # --depth', "",
                                        "[inner]", "depth = 5  # $T_INNER__DEPTH"]
    table = settings_table(_Outer, "x", "T_")
    assert "| `inner.depth` | `--depth`, `-d` | `T_INNER__DEPTH` | `3` | How deep. |" in table


def test_a_flag_without_help_is_refused():
    class Bare(BaseModel):
        n: Annotated[int, flag("--n")] = 1

    with pytest.raises(TypeError, match="needs a description"):
        flag_specs(Bare, "x")


def test_run_print_config_names_each_source(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path), "TMAX_MAX_STEPS": "9", "TMAX_BASE_URL": "", "OPENAI_BASE_URL": "",
           "TMAX_MODEL": ""}
    cfg = tmp_path / "mine.toml"
    cfg.write_text('base_url = "http://file/v1"\nmodel = "m"\ntemperature = 0.3\n')
    r = tmax("run", "-s", "local", "-c", str(cfg), "--print-config", "a task", env=env)
    assert r.exit_code == 0, r.output
    assert "note: --sandbox/-s is now --env" in r.stderr
    assert shown(r, "", "sandbox") == 'sandbox = "local"  # --sandbox/-s'
    assert shown(r, "", "base_url") == f'base_url = "http://file/v1"  # {cfg}'
    assert shown(r, "", "max_steps") == "max_steps = 9  # $TMAX_MAX_STEPS"
    assert shown(r, "", "temperature") == f"temperature = 0.3  # {cfg}"
    assert shown(r, "", "compaction") == "compaction = true  # default (tmax run)"
    r = tmax("run", "-c", str(tmp_path / "none.toml"), "--print-config", "x", env=env)
    assert r.exit_code == 2 and "config file not found" in r.output


def test_the_docs_settings_tables_are_the_declarations():
    from tmax.cli.settings_docs import BLOCK, PAGES, render

    found = {m["name"] for page in PAGES.glob("*.md") for m in BLOCK.finditer(page.read_text())}
    assert found == {"run", "bench", "learn", "generate"}
    for page in PAGES.glob("*.md"):
        text = page.read_text()
        assert render(text) == text, f"{page}: run `python -m tmax.cli.settings_docs`"
    assert "| `algo.steps` | `--steps` | `TMAX_LEARN_ALGO__STEPS` | `500` | RL steps. |" in \
        (PAGES / "learn.md").read_text()


def test_bench_settings_from_file_environment_flags_and_ak(tmp_path):
    cfg = tmp_path / "bench.toml"
    cfg.write_text('dataset = "ds"\nagent = "tmax"\nn_attempts = 3\nmax_steps = 8\ntemperature = 0.1\n')
    env = {"TMAX_BENCH_N_ATTEMPTS": "4", "TMAX_BASE_URL": "http://env/v1"}
    r = tmax("bench", "run", "-c", str(cfg), "-n", "2", "--ak", "temperature=0.5", "--print-config", env=env)
    assert r.exit_code == 0, r.output
    assert shown(r, "", "dataset") == f'dataset = "ds"  # {cfg}'
    assert shown(r, "", "n_attempts") == "n_attempts = 4  # $TMAX_BENCH_N_ATTEMPTS"
    assert shown(r, "", "base_url") == 'base_url = "http://env/v1"  # $TMAX_BASE_URL'
    assert shown(r, "", "n_concurrent") == "n_concurrent = 2  # --n-concurrent"
    assert shown(r, "", "temperature") == "temperature = 0.5  # --ak"
    assert shown(r, "", "max_steps") == f"max_steps = 8  # {cfg}"
    # terminal-bench: the same settings, the protocol's defaults, k = 5 whatever the environment says.
    r = tmax("bench", "terminal-bench", "-n", "8", "--print-config", env=env)
    assert r.exit_code == 0, r.output
    assert shown(r, "", "dataset") == "dataset = \"terminal-bench@2.0\"  # the command's default"
    assert shown(r, "", "n_attempts") == "n_attempts = 5  # the command's protocol"
    assert shown(r, "", "n_concurrent") == "n_concurrent = 8  # --n-concurrent"
    help_text = tmax("bench", "terminal-bench", "--help").stdout
    assert "Default: tmax." in help_text and "--n-attempts" not in help_text
    # --ak sets agent settings only: a job setting or a typo there is an error naming agent settings.
    for item in ("dataset=elsewhere", "max_step=3"):
        r = tmax("bench", "run", "-c", str(cfg), "--ak", item, "--print-config")
        assert r.exit_code == 2 and "unknown agent setting(s)" in r.output, r.output


@pytest.mark.parametrize("args", [("learn", "nano", "-c", "nano-podman"), ("learn", "-c", "tmax-9b"),
                                  ("learn", "sft", "-c", "nano-long"), ("run",), ("bench", "run", "tasks")])
def test_print_config_is_a_config_file(args, tmp_path):
    """What --print-config prints is TOML (an unset setting a comment), so it can be saved and
    given back with -c; `tmax run` shows its settings even before a base URL is set."""
    import tomllib

    r = tmax(*args, "--print-config", env={"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    assert r.exit_code == 0, r.output
    parsed = tomllib.loads(r.stdout)
    assert parsed
    if args[0] == "run":
        assert "base_url" not in parsed and "# base_url unset" in r.stdout
    if args[0] == "learn":  # given back as a config file, it resolves to the same settings
        saved = tmp_path / "saved.toml"
        saved.write_text(r.stdout)
        again = tmax(*args[:-2], "-c", str(saved), "--print-config", env={"HOME": str(tmp_path)})
        assert again.exit_code == 0, again.output
        assert {k: v for k, v in tomllib.loads(again.stdout).items() if k != "name"} == \
            {k: v for k, v in parsed.items() if k != "name"}


def test_the_base_image_is_named_once():
    """`localhost/tmax-base:bookworm` is spelled in one module (sandbox/base_image.py); the podman
    default, the tasks' base, the host environments, the nano tasks and build-base import it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "tmax"
    spelled = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*.py"))
               if '"localhost/tmax-base:bookworm' in p.read_text(encoding="utf-8")]  # as a value, not in prose
    assert spelled == ["sandbox/base_image.py"]


def _undescribed(model: type[BaseModel]) -> list[str]:
    return [".".join(path) for path, info in leaf_fields(model) if not (info.description or "").strip()]


def test_every_setting_has_a_description():
    """Each setting of every command's declaration (learn's sections, run's keys and file,
    bench's job and the job spec it makes, serve's server, data generate's run and its axes)
    says what it is: the help, the docs' tables and --print-config show it."""
    from tmax.cli.bench_settings import BenchSettings
    from tmax.cli.run_settings import RunFile, RunKeys
    from tmax.training.config import LearnConfig
    from tmax.tasks.corpus.generate_config import GenerateConfig
    from tmax.training.inference.serving import ServeSpec

    from tmax.tasks.corpus.axes import AxesConfig, DomainAxes, TaskAxes
    from tmax.tasks.job import JobSpec

    missing = {m.__name__: _undescribed(m) for m in (LearnConfig, RunKeys, RunFile, BenchSettings, ServeSpec,
                                                      GenerateConfig, JobSpec, AxesConfig, DomainAxes, TaskAxes)}
    assert not any(missing.values()), f"settings without a description: {missing}"
    assert _undescribed(_Outer) == [] and _undescribed(type("Bare", (BaseModel,), {"__annotations__": {"n": int}})) == ["n"]
