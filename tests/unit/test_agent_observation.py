"""Observation formatting: exact strings."""

from tmax.agents.observation import ObservationLimits, format_observation, truncate
from tmax.agents.prompts import TOO_LONG_HINT
from tmax.sandbox.base import CommandResult


def obs(output="", code=0, **kw):
    return format_observation(CommandResult(output=output, exit_code=code, **kw))


def test_plain_output_then_exit_code():
    assert obs("hello\nworld\n") == "hello\nworld\n\n(exit_code=0)"


def test_trailing_whitespace_is_stripped_but_leading_is_kept():
    assert obs("  x  \n\n\t\n", 3) == "  x\n\n(exit_code=3)"


def test_no_output():
    assert obs("") == "(no output)\n\n(exit_code=0)"
    assert obs("\n \n", 1) == "(no output)\n\n(exit_code=1)"


def test_stderr_comes_after_stdout():
    assert obs("out\n", 2, stderr="err\n") == "out\n\nerr\n\n(exit_code=2)"
    assert obs("out", 2, stderr="err") == "out\nerr\n\n(exit_code=2)"
    assert obs("", 2, stderr="only err") == "only err\n\n(exit_code=2)"


def test_compose_noise_is_removed():
    out = (
        ">>>> Executing external compose provider \"/usr/bin/docker-compose\". Please refer to the documentation <<<<\n"
        "real output\n"
        "Error: executing /usr/bin/docker-compose exec main bash: exit status 1\n"
    )
    assert obs(out, 1) == "real output\n\n(exit_code=1)"


def test_sandbox_note_is_included():
    assert obs("partial", 124, note="command timed out after 120 s and was interrupted") == (
        "partial\n\ncommand timed out after 120 s and was interrupted\n\n(exit_code=124)"
    )


def test_exactly_max_chars_is_not_truncated():
    text = "a" * 10000
    assert obs(text) == text + "\n\n(exit_code=0)"


def test_long_output_head_and_tail():
    text = "H" * 5000 + "M" * 2345 + "T" * 5000
    expected = (
        TOO_LONG_HINT
        + "\n\n---- HEAD (5000 chars) ----\n"
        + "H" * 5000
        + "\n---- 2345 chars elided ----\n---- TAIL (5000 chars) ----\n"
        + "T" * 5000
        + "\n\n(exit_code=0)"
    )
    assert obs(text) == expected


def test_head_and_tail_are_not_cut_at_lines():
    text = "".join(f"line {i}\n" for i in range(3000))  # ~26k chars
    body = truncate(text.rstrip())
    head = body.split("---- HEAD (5000 chars) ----\n", 1)[1].split("\n---- ", 1)[0]
    assert head == text[:5000]
    assert body.endswith(text.rstrip()[-5000:])


def test_dropped_chars_count_as_elided():
    # The sandbox kept 6000 + 6000 characters and dropped 100,000 from the middle.
    kept = "a" * 6000 + "b" * 6000
    body = truncate(kept, dropped_chars=100000)
    assert "---- 102000 chars elided ----" in body
    assert body.endswith("b" * 5000)


def test_small_limits_for_training_presets():
    limits = ObservationLimits(max_chars=20, head_chars=5, tail_chars=5)
    out = format_observation(CommandResult(output="0123456789abcdefghijXYZ", exit_code=0), limits)
    assert out == (
        TOO_LONG_HINT + "\n\n---- HEAD (5 chars) ----\n01234\n---- 13 chars elided ----\n---- TAIL (5 chars) ----\nijXYZ\n\n(exit_code=0)"
    )


def test_hint_length_close_to_reference():
    assert abs(len(TOO_LONG_HINT) - 452) <= 15
