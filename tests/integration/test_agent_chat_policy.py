"""ChatPolicy over real HTTP against the scripted server: request shape and error mapping."""

import json

import pytest
from scripted_server import ScriptedServer

from tmax.agents.chat_policy import ChatPolicy
from tmax.agents.policy import ContextOverflow, FatalModelError, ModelError
from tmax.agents.prompts import instance_message, system_message
from tmax.agents.tools import TOOLS

MESSAGES = [system_message(), instance_message("say hi")]


def policy(srv, **kw):
    return ChatPolicy(model=srv.model, base_url=srv.base_url, api_key=kw.pop("api_key", None), **kw)


def test_request_has_vanillux_sampling_and_no_tool_choice():
    with ScriptedServer([{"content": "THOUGHT: hi", "bash": "echo hi", "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}}]) as srv:
        turn = policy(srv).complete(MESSAGES, TOOLS)
        (req,) = srv.requests
    assert req["model"] == "scripted-model"
    assert req["messages"] == MESSAGES
    assert req["tools"] == TOOLS
    assert req["temperature"] == 0.7 and req["top_p"] == 0.95 and req["max_tokens"] == 16384
    for absent in ("tool_choice", "stop", "top_k", "stream"):
        assert absent not in req
    msg = turn.message
    assert msg["role"] == "assistant" and msg["content"] == "THOUGHT: hi"
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "bash", "arguments": json.dumps({"command": "echo hi"})}
    assert call["id"].startswith("chatcmpl-tool-")
    assert (turn.usage.prompt_tokens, turn.usage.completion_tokens, turn.usage.total_tokens) == (100, 7, 107)
    assert turn.finish_reason == "tool_calls" and turn.latency_s > 0


def test_top_k_goes_in_the_body_and_reasoning_is_kept():
    with ScriptedServer([{"content": "x", "reasoning_content": "hmm"}]) as srv:
        turn = policy(srv, top_k=20).complete(MESSAGES, TOOLS)
        assert srv.requests[0]["top_k"] == 20
    assert turn.message == {"role": "assistant", "content": "x", "reasoning_content": "hmm"}


def test_raw_tool_call_text_is_normalised_to_native_calls():
    raw = "THOUGHT: look\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
    with ScriptedServer([{"content": raw}]) as srv:
        msg = policy(srv).complete(MESSAGES, TOOLS).message
    assert msg["content"] == "THOUGHT: look"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"command": "ls -la"}


@pytest.mark.parametrize(
    "turn, exc, text",
    [
        ({"error": "auth"}, FatalModelError, "authentication"),
        ({"error": "not_found"}, FatalModelError, "not found"),
        ({"error": "permission"}, FatalModelError, "permission"),
        ({"error": "bad_request"}, FatalModelError, "rejected"),
        ({"error": "context_length"}, ContextOverflow, "context"),
        ({"error": "server"}, ModelError, "500"),
        ({"error": "unavailable"}, ModelError, "503"),
        ({"status": 429, "message": "rate limited"}, ModelError, "429"),
    ],
)
def test_error_mapping(turn, exc, text):
    with ScriptedServer([turn]) as srv:
        with pytest.raises(exc, match=f"(?i){text}"):
            policy(srv).complete(MESSAGES, TOOLS)
        assert len(srv.requests) == 1  # the client itself never retries


def test_wrong_api_key_is_fatal():
    with ScriptedServer([{"content": "x"}], api_key="secret") as srv:
        with pytest.raises(FatalModelError):
            policy(srv, api_key="wrong").complete(MESSAGES, TOOLS)
        assert policy(srv, api_key="secret").complete(MESSAGES, TOOLS).message["content"] == "x"


def test_timeout_and_connection_errors_are_retryable():
    with ScriptedServer([{"content": "slow", "delay": 2}]) as srv:
        with pytest.raises(ModelError, match="timed out"):
            policy(srv, timeout=0.3).complete(MESSAGES, TOOLS)
        url = srv.base_url
    with pytest.raises(ModelError, match="reach"):
        ChatPolicy(model="m", base_url=url, timeout=2).complete(MESSAGES, TOOLS)


def test_scripted_server_as_a_process_and_models_endpoint():
    import httpx

    with ScriptedServer([{"bash": "ls"}], model="proc-model", process=True) as srv:
        assert httpx.get(srv.base_url + "/models", timeout=5).json()["data"][0]["id"] == "proc-model"
        turn = policy(srv).complete(MESSAGES, TOOLS)
        assert turn.message["tool_calls"][0]["function"]["name"] == "bash"
        assert srv.requests[0]["messages"] == MESSAGES
        # Exhausted script: a loud, non-retryable error.
        with pytest.raises(FatalModelError, match="exhausted"):
            policy(srv).complete(MESSAGES, TOOLS)


def test_max_tokens_fitted_to_the_window_the_server_lists():
    """vLLM lists max_model_len: a 4,096-token server never gets asked for 16,384 tokens."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 96, "total_tokens": 1096}
    with ScriptedServer([{"content": "a", "usage": usage}, {"content": "b"}], max_model_len=4096) as srv:
        p = policy(srv, max_tokens=16384)
        p.complete(MESSAGES, TOOLS)
        p.complete(MESSAGES + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}], TOOLS)
        asked = [r["max_tokens"] for r in srv.requests]
    assert p.window == 4096
    assert asked == [4096, 4096 - 1096]  # the second prompt holds at least the first turn


def test_max_tokens_fitted_from_the_error_when_the_server_lists_no_window():
    script = [{"error": "max_tokens_too_large"}, {"content": "ok"}]
    with ScriptedServer(script) as srv:
        turn = policy(srv, max_tokens=16384).complete(MESSAGES, TOOLS)
        asked = [r["max_tokens"] for r in srv.requests]
    assert turn.message["content"] == "ok" and asked == [16384, 4096]
    # An error that gives the prompt's length too: the retry asks for what is left.
    msg = ("This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
           "(3000 in the messages, 6000 in the completion).")
    with ScriptedServer([{"status": 400, "message": msg}, {"content": "ok"}]) as srv:
        policy(srv, max_tokens=6000).complete(MESSAGES, TOOLS)
        assert [r["max_tokens"] for r in srv.requests] == [6000, 8192 - 3000]


def test_connection_error_names_the_url():
    with ScriptedServer([]) as srv:
        url = srv.base_url
    with pytest.raises(ModelError, match=f"at {url}/chat/completions"):
        ChatPolicy(model="m", base_url=url, timeout=2).complete(MESSAGES, TOOLS)
