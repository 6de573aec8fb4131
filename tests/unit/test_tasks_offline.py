"""Offline adaptation: Dockerfile rewrite, per-task patches, the verifier's uv rewrite."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

import pytest

from tmax.tasks.task_format import Task
from tmax.tasks.offline import CA_TARGET, DATA_DIR, RewriteConfig, default_config, parse_image_map, rewrite_dockerfile
from tmax.tasks.verifier import parse_reward, rewrite_test_sh

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "tb2-sample"
BASE = "localhost/tmax-base:bookworm"
needs_sample = pytest.mark.skipif(not SAMPLE.is_dir(), reason="tb2 sample not present")


def cfg(**kw) -> RewriteConfig:
    return default_config(ca_bundle=kw.pop("ca", None), **kw)


def test_python_image_gets_python_steps():
    out = rewrite_dockerfile("FROM python:3.13-slim-bookworm\nWORKDIR /app\nRUN pip install x\n", cfg())
    lines = out.text.splitlines()
    assert lines[0] == f"FROM {BASE}"
    assert any("python3-venv" in l and "python3-dev" in l and "python-is-python3" in l for l in lines)
    assert "ENV PIP_BREAK_SYSTEM_PACKAGES=1" in lines
    assert lines.index("RUN pip install x") > lines.index("WORKDIR /app")
    assert lines[-1] == "RUN mkdir -p /app"
    assert out.base_images == [BASE]


def test_ubuntu_multistage_keeps_stage_names():
    text = "FROM ubuntu:24.04 as build\nRUN true\nFROM ubuntu:24.04 AS target\nCOPY --from=build /a /a\nFROM build\n"
    out = rewrite_dockerfile(text, cfg())
    froms = [l for l in out.text.splitlines() if l.startswith("FROM")]
    assert froms == [f"FROM {BASE} as build", f"FROM {BASE} AS target", "FROM build"]
    assert out.base_images == [BASE, BASE]
    assert not any("python3" in l for l in out.text.splitlines())


def test_continued_lines_are_read_as_one_instruction():
    """A FROM or WORKDIR split over lines (and a comment inside a RUN) reads as Docker reads it;
    before, a line-by-line regex took `\\` for the image and missed the WORKDIR."""
    text = ("FROM \\\n    python:3.12-slim\nRUN apt-get update && \\\n    # a comment inside\n"
            "    apt-get install -y jq\nWORKDIR \\\n  /srv/app\n")
    out = rewrite_dockerfile(text, cfg())
    assert out.base_images == [BASE]
    lines = out.text.splitlines()
    assert lines[0] == f"FROM {BASE}" and "python:3.12-slim" not in out.text
    assert "    apt-get install -y jq" in lines  # the rest is kept as written
    assert lines[-1] == "RUN mkdir -p /srv/app"


def test_generated_dockerfile_user_read_across_a_continuation():
    from tmax.tasks.corpus.stage_prompts import ParseError, parse_environment

    answer = "<dockerfile>\nFROM x\nUSER \\\n  user\n</dockerfile>\n<solve>\ntrue\n</solve>"
    with pytest.raises(ParseError, match="USER user"):
        parse_environment(answer)


def test_cli_image_map_wins_and_adds_no_setup():
    c = default_config(image_map=["python:*=localhost/mypy:3.13"], ca_bundle=None)
    out = rewrite_dockerfile("FROM python:3.13-slim-bookworm\n", c)
    assert out.text.splitlines()[0] == "FROM localhost/mypy:3.13"
    assert "python3-venv" not in out.text
    with pytest.raises(ValueError, match="FROM=TO"):
        parse_image_map(["nonsense"])


def test_ca_env_injected_per_stage(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    out = rewrite_dockerfile("FROM debian:13.0-slim\nFROM ubuntu:24.04\n", cfg(ca=ca))
    assert out.text.count(f"PIP_CERT={CA_TARGET}") == 2
    assert "unmapped" not in out.text


def test_unknown_image_left_alone():
    out = rewrite_dockerfile("FROM quay.io/foo/bar:1\n", cfg())
    assert out.text.startswith("FROM quay.io/foo/bar:1") and out.base_images == ["quay.io/foo/bar:1"]


@needs_sample
def test_every_patch_applies_to_the_sample():
    """A patch whose text is gone from its task is an error at build time; catch it here."""
    patches = tomllib.loads((DATA_DIR / "patches.toml").read_text())["patch"]
    assert patches
    for p in patches:
        f = SAMPLE / p["task"] / p["file"]
        assert f.is_file(), f
        assert p["find"] in f.read_text(), (p["task"], p["file"], p["find"][:60])
        assert p["why"]


@needs_sample
def test_sample_dockerfiles_need_no_registry():
    """After the rewrite, no FROM / COPY --from names a registry image."""
    c = cfg()
    for d in sorted(SAMPLE.iterdir()):
        if not (d / "task.toml").exists():
            continue
        text = (d / "environment" / "Dockerfile").read_text()
        for p in c.patches_for(d.name, "environment/Dockerfile"):
            text = text.replace(p.find, p.replace)
        out = rewrite_dockerfile(text, c)
        assert set(out.base_images) == {BASE}, d.name
        assert "--from=ghcr.io" not in out.text and "notofonts.github.io" not in out.text, d.name


def test_offline_infeasible_list_is_well_formed():
    data = tomllib.loads((DATA_DIR / "offline_infeasible.toml").read_text())
    for entry in data.get("task", []):
        assert entry["name"] and entry["why"]
        if SAMPLE.is_dir():
            assert (SAMPLE / entry["name"] / "task.toml").is_file(), entry["name"]


UVX = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
cp /tests/test.py /app/test.py
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w numpy==2.3.3 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA


if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def test_uvx_rewrite_keeps_everything_else():
    out, changed = rewrite_test_sh(UVX)
    assert changed
    code = "\n".join(l for l in out.splitlines() if not l.lstrip().startswith("#"))
    assert "astral.sh" not in code and ".local/bin/env" not in code and "uvx" not in code
    assert "cp /tests/test.py /app/test.py" in out and "apt-get install -y curl" in out
    assert "pip install -q pytest==8.4.1 numpy==2.3.3 pytest-json-ctrf==0.3.5" in out
    lines = out.splitlines()
    i = lines.index("pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA")
    # pytest stays the last command before the reward check, so $? is pytest's.
    assert [l for l in lines[i + 1:] if l.strip()][0].startswith("if [ $? -eq 0 ]")
    assert "-p 3.13" not in out and "python3-dev" not in out
    assert "python3-dev gcc" in rewrite_test_sh(UVX, needs_headers=True)[0]


def test_plain_pip_script_unchanged():
    text = "#!/bin/bash\npip install pytest==8.4.2\npytest /tests/test_outputs.py -rA\n"
    assert rewrite_test_sh(text) == (text, False)


@needs_sample
def test_every_sample_verifier_is_rewritten():
    for d in sorted(SAMPLE.iterdir()):
        sh = d / "tests" / "test.sh"
        if not sh.is_file():
            continue
        original = sh.read_text()
        out, changed = rewrite_test_sh(original)
        assert changed == ("uvx" in original), d.name
        code = "\n".join(l for l in out.splitlines() if not l.lstrip().startswith("#"))
        assert "astral.sh" not in code and "uvx" not in code, d.name
        for line in original.splitlines():  # every -w pin survives
            tokens = shlex.split(line.strip().rstrip("\\")) if line.strip().startswith("-w") else []
            if tokens:
                assert tokens[1] in out, (d.name, tokens[1])
        assert "/logs/verifier/reward.txt" in out


@pytest.mark.parametrize("txt,js,expect", [
    ("1\n", None, 1.0), ("0", None, 0.0), ("1.7", None, 1.0), ("-2", None, 0.0), ("0.25", None, 0.25),
    (None, '{"reward": 0.5}', 0.5), (None, "0.75", 0.75), (None, '{"accuracy": 0.2}', 0.2),
])
def test_reward_parsing(txt, js, expect):
    assert parse_reward(txt, js) == (expect, "ok", None)


@pytest.mark.parametrize("txt,js,kind,why", [
    (None, None, "no_reward", "no /logs/verifier/reward.txt"), ("", None, "empty_reward", "empty"),
    ("yes", None, "parse_error", "not a number"), ("nan", None, "parse_error", "NaN"),
    (None, "{", "parse_error", "not JSON"), (None, '{"a": "b"}', "parse_error", "no numeric"),
])
def test_reward_errors(txt, js, kind, why):
    reward, got, err = parse_reward(txt, js)
    assert reward is None and got == kind and why in err


@needs_sample
def test_task_checksum_is_stable():
    t = Task.load(SAMPLE / "regex-log")
    assert t.checksum() == Task.load(SAMPLE / "regex-log").checksum()
