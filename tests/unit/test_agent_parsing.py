"""Tool-call parsing: native tool_calls, raw qwen3_xml text, raw hermes JSON text."""

import json

from tmax.agents.parsing import Action, message_from_text, parse_action, parse_text
from tmax.agents.prompts import SUBMIT_MARKER


def native(*calls, content="THOUGHT: go"):
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(calls)
        ],
    }


def test_native_bash_call_is_stripped_and_keeps_id():
    a = parse_action(native(("bash", json.dumps({"command": "  ls -la \n"}))))
    assert a == Action(command="ls -la", tool_call_id="call_0", submit=False, error=None)


def test_only_the_first_call_is_used():
    a = parse_action(native(("bash", '{"command": "echo one"}'), ("bash", '{"command": "echo two"}')))
    assert a.command == "echo one" and a.tool_call_id == "call_0"


def test_dict_arguments_are_accepted():
    assert parse_action(native(("bash", {"command": "pwd"}))).command == "pwd"


def test_non_bash_tool_is_a_format_error_that_keeps_the_id():
    a = parse_action(native(("python", '{"code": "print(1)"}'), ("bash", '{"command": "ls"}')))
    assert a.is_format_error and a.command is None
    assert a.tool_call_id == "call_0"
    assert "python" in a.error


def test_unparseable_arguments_are_a_format_error_without_id():
    a = parse_action(native(("bash", '{"command": "ls"')))
    assert a.is_format_error and a.tool_call_id is None


def test_missing_or_empty_command_is_a_format_error():
    assert parse_action(native(("bash", "{}"))).is_format_error
    assert parse_action(native(("bash", '{"command": 3}'))).is_format_error
    assert parse_action(native(("bash", '{"command": "   "}'))).is_format_error


def test_no_call_is_a_format_error():
    a = parse_action({"role": "assistant", "content": "I think I am done."})
    assert a.is_format_error and a.tool_call_id is None and a.error == "no tool call"
    assert parse_action({"role": "assistant", "content": None}).is_format_error


def test_submit_marker_anywhere_in_the_command_is_a_submit():
    a = parse_action(native(("bash", json.dumps({"command": f"echo {SUBMIT_MARKER}"}))))
    assert a.submit and a.command == f"echo {SUBMIT_MARKER}"
    b = parse_action(native(("bash", json.dumps({"command": f"make test && echo {SUBMIT_MARKER}"}))))
    assert b.submit
    assert not parse_action(native(("bash", '{"command": "echo COMPLETE_TASK"}'))).submit


QWEN_XML = """<think>
Let me look around first.
</think>

THOUGHT: list the files.
<tool_call>
<function=bash>
<parameter=command>
cat > a.txt << 'EOF'
  indented line
EOF
</parameter>
</function>
</tool_call>"""


def test_raw_qwen3_xml_text():
    content, calls = parse_text(QWEN_XML)
    assert content == "<think>\nLet me look around first.\n</think>\n\nTHOUGHT: list the files."
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == "bash"
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "cat > a.txt << 'EOF'\n  indented line\nEOF"}


def test_raw_text_in_content_is_parsed_when_there_are_no_native_calls():
    a = parse_action({"role": "assistant", "content": QWEN_XML})
    assert a.command == "cat > a.txt << 'EOF'\n  indented line\nEOF"
    assert a.tool_call_id is None  # raw text has no id: the loop answers with a user message


def test_raw_hermes_json_text():
    text = 'THOUGHT: hi\n<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi"}}\n</tool_call>'
    content, calls = parse_text(text)
    assert content == "THOUGHT: hi"
    assert calls == [{"type": "function", "function": {"name": "bash", "arguments": '{"command": "echo hi"}'}}]


def test_raw_hermes_without_newlines_and_string_arguments():
    text = '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
    msg = message_from_text(text)
    assert msg["content"] == ""
    assert parse_action(msg).command == "ls"


def test_raw_hermes_broken_json_is_a_format_error():
    msg = message_from_text('THOUGHT\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}\n</tool_call>')
    a = parse_action(msg)
    assert a.is_format_error and a.tool_call_id is None


def test_raw_text_first_of_several_calls_and_mixed_formats():
    text = (
        "<tool_call>\n<function=bash>\n<parameter=command>\necho 1\n</parameter>\n</function>\n</tool_call>\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "echo 2"}}\n</tool_call>'
    )
    content, calls = parse_text(text)
    assert content == "" and len(calls) == 2
    assert json.loads(calls[1]["function"]["arguments"]) == {"command": "echo 2"}
    assert parse_action(message_from_text(text)).command == "echo 1"


def test_call_inside_thinking_is_not_run():
    text = '<think>\nmaybe <tool_call>{"name": "bash", "arguments": {"command": "rm -rf /"}}</tool_call>\n</think>\n\nI am done.'
    content, calls = parse_text(text)
    assert calls == [] and content == text


def test_truncated_xml_call_is_still_read():
    text = "<tool_call>\n<function=bash>\n<parameter=command>\nls /tmp\n"
    _, calls = parse_text(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "ls /tmp"}


def test_message_from_text_assigns_ids_and_native_shape():
    msg = message_from_text(QWEN_XML)
    assert msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert parse_action(msg).tool_call_id == call["id"]
    plain = message_from_text("just words")
    assert plain == {"role": "assistant", "content": "just words"}
