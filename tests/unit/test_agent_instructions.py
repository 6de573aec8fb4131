"""Project instructions (`agents.instructions`): which AGENTS.md files, in what order, the cap,
and where they go in the prompt. Through `tmax run` (listed, recorded, bad files):
tests/integration/test_cli_run_compact.py."""

from __future__ import annotations

import pytest

from tmax.agents.harnesses import make_harness
from tmax.agents.instructions import HEADING, InstructionsError, agents_files, load_instructions, with_instructions


def test_files_from_the_repository_root_down_to_the_working_directory(tmp_path):
    repo, deep = tmp_path / "repo", tmp_path / "repo" / "a" / "b"
    deep.mkdir(parents=True)
    (repo / ".git").mkdir()
    for d in (tmp_path, repo, repo / "a" / "b"):
        (d / "AGENTS.md").write_text(f"rules of {d.name}\n")
    assert agents_files(deep) == [repo / "AGENTS.md", deep / "AGENTS.md"]  # not above the root
    outside = tmp_path / "plain"
    outside.mkdir()
    assert agents_files(outside) == []  # no repository: the working directory's own only
    (outside / "AGENTS.md").write_text("x")
    assert agents_files(outside) == [outside / "AGENTS.md"]


def test_the_cap_cuts_and_says_so(tmp_path):
    a, b, empty = tmp_path / "a.md", tmp_path / "b.md", tmp_path / "empty.md"
    a.write_text("A" * 60)
    b.write_text("B" * 60)
    empty.write_text("\n")
    loaded = load_instructions([a, empty, b], max_chars=100)
    assert [(s.path, s.chars, s.kept) for s in loaded.sources] == [(str(a), 60, 60), (str(b), 60, 40)]
    assert loaded.cut and loaded.text.startswith(HEADING)
    assert f"## {a}\n\n{'A' * 60}" in loaded.text and "B" * 40 + "\n\n[... 20 more characters cut: the limit is 100]" in loaded.text
    assert "cut to 40 of 60 characters" in loaded.describe()
    with pytest.raises(InstructionsError, match="cannot read the instructions file"):
        load_instructions([tmp_path / "missing.md"])


def test_they_end_the_system_prompt_or_are_one():
    messages = make_harness("tmax").initial_messages("task")
    out = with_instructions(messages, "RULES")
    assert out[0]["content"] == messages[0]["content"] + "\n\nRULES" and out[1:] == messages[1:]
    assert messages[0]["content"].endswith("short and to the point.")  # the harness's own list is untouched
    terminus = make_harness("terminus-2").initial_messages("task")
    assert with_instructions(terminus, "RULES") == [{"role": "system", "content": "RULES"}, *terminus]
    assert with_instructions(messages, None) is messages
