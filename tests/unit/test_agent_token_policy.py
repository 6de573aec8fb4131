"""TokenPolicy with a real tokenizer (a tiny byte-level BPE trained here) and a real chat
template: the token context the sampler saw must equal the tokenisation of the
canonical rendering of the whole conversation, with masks and logprobs lined up."""

from __future__ import annotations

import json

import pytest

from tmax.agents.loop import Agent
from tmax.agents.agent_settings import AgentSettings
from tmax.agents.policy import ContextOverflow, SampledTokens
from tmax.agents.prompts import SUBMIT_MARKER
from tmax.agents.token_policy import TokenPolicy
from tmax.agents.tools import TOOLS
from tmax.sandbox import SandboxSpec, make_sandbox

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Templates are written as concatenated strings. A newline right after a block tag is
# written as {{ '\\n' }} because transformers renders with trim_blocks=True.

# Qwen2.5-style: hermes JSON tool calls, tool results as a user turn.
HERMES_TEMPLATE = (
    "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% else %}{% set sys = '' %}{% endif %}"
    "<|im_start|>system\n{{ sys }}"
    "{% if tools %}{{ '\n' }}\n# Tools\n\n<tools>{% for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "Call a function with <tool_call>\n{\"name\": <name>, \"arguments\": <args-json-object>}\n</tool_call>{% endif %}"
    "<|im_end|>\n"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}{% if m.content or not loop.first %}{{ '\n' }}{% endif %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3.5-style: qwen3_xml tool calls, thinking opened by the generation prompt, and
# assistant turns re-rendered with their <think> prefix (preserved thinking).
XML_TEMPLATE = (
    "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% else %}{% set sys = '' %}{% endif %}"
    "<|im_start|>system\n{{ sys }}"
    "{% if tools %}{{ '\n' }}\n# Tools\n\n<tools>{% for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}{{ '\n' }}</tools>{% endif %}"
    "<|im_end|>\n"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}{% set c = m.content or '' %}<|im_start|>assistant\n"
    "{% if '</think>' in c and not c.startswith('<think>') %}<think>\n{% endif %}{{ c }}"
    "{% for tc in (m.tool_calls or []) %}{% if c or not loop.first %}{{ '\n' }}{% endif %}<tool_call>\n<function={{ tc.function.name }}>"
    "{% for k, v in tc.function.arguments.items() %}{{ '\n' }}<parameter={{ k }}>\n{{ v }}\n</parameter>{% endfor %}"
    "{{ '\n' }}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def base_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = [
        "THOUGHT: I will look at the files first and then run the tests.",
        'echo hello && ls -la /tmp && cat file.txt | grep -n error',
        json.dumps({"name": "bash", "arguments": {"command": "echo 1 && pwd"}}),
        "(exit_code=0) (no output) Format error: Your last response did not include a valid `bash` tool call.",
        "<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>",
    ] * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])


def tokenizer_with(base, template):
    import copy

    tok = copy.deepcopy(base)
    tok.chat_template = template
    return tok


class ScriptedSampler:
    """A real TokenSampler over scripted texts: emits their token ids (+ <|im_end|> unless
    cut by max_tokens) with distinct logprobs, and records what it was asked."""

    def __init__(self, tokenizer, texts, stop=True):
        self.tok = tokenizer
        self.texts = list(texts)
        self.stop = stop
        self.calls = []
        self.n = 0

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None):
        self.calls.append({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed})
        text, stop = self.texts.pop(0), self.stop
        if isinstance(text, tuple):  # (text, False): the model ran out of tokens mid-turn
            text, stop = text
        ids = self.tok.encode(text, add_special_tokens=False)
        if stop:
            ids = ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        finish = "stop" if stop else "length"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        self.n += 1
        logprobs = [-(self.n + i / 1000) for i in range(len(ids))]
        return SampledTokens(ids=ids, logprobs=logprobs, finish_reason=finish, policy_version=self.n)


def hermes_call(command, thought="THOUGHT: next."):
    return f'{thought}\n<tool_call>\n{json.dumps({"name": "bash", "arguments": {"command": command}})}\n</tool_call>'


def xml_call(command, thought="I should act.\n</think>\n\nTHOUGHT: next."):
    return f"{thought}\n<tool_call>\n<function=bash>\n<parameter=command>\n{command}\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture
def box(tmp_path):
    b = make_sandbox("local", SandboxSpec(workdir=str(tmp_path)))
    b.start()
    yield b
    b.close()


def canonical(tok, messages, xml=False):
    """The whole conversation rendered at once, as a chat server would re-render it."""
    msgs = json.loads(json.dumps(messages))
    if xml:  # the xml template iterates arguments as a mapping (vLLM passes dicts)
        for m in msgs:
            for tc in m.get("tool_calls") or []:
                tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    return tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=False, tokenize=False)


@pytest.mark.parametrize("compaction", [False, True], ids=["protocol", "counted"])
@pytest.mark.parametrize("style", ["hermes", "xml"])
def test_trace_equals_canonical_tokenisation(style, compaction, base_tokenizer, box):
    """Also with compaction on (each request counted before it is sent, by the template, its
    tool-call arguments as mappings as vLLM passes them): the same trace."""
    xml = style == "xml"
    tok = tokenizer_with(base_tokenizer, XML_TEMPLATE if xml else HERMES_TEMPLATE)
    call = xml_call if xml else hermes_call
    texts = [
        call("export A=1 && echo start"),
        "I am not sure what to do." if not xml else "Hmm.\n</think>\n\nI am not sure what to do.",  # format error
        call('echo "A=$A"'),
        call(f"echo {SUBMIT_MARKER}"),
    ]
    sampler = ScriptedSampler(tok, texts)
    policy = TokenPolicy(sampler, tok, temperature=1.0, top_p=1.0, seed=7)
    result = Agent(policy, box, AgentSettings(compaction=compaction)).run("Say hello.")
    assert result.status == "submitted" and result.steps == 4
    trace = policy.trace

    # The sampler always saw exactly the trace context so far.
    sampled_lens = []
    for i, c in enumerate(sampler.calls):
        assert c["prompt_ids"] == trace.context[: len(c["prompt_ids"])]
        assert (c["temperature"], c["top_p"], c["seed"]) == (1.0, 1.0, 7)
        sampled_lens.append(len(tok.encode(texts[i], add_special_tokens=False)) + 1)

    # prompt = [system, user] + tools rendered once with the generation prompt.
    prompt_text = tok.apply_chat_template(result.messages[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert trace.prompt_ids == tok.encode(prompt_text, add_special_tokens=False)

    # The whole context equals the canonical rendering of the conversation up to the last
    # assistant turn (whose trailing newline the sampler never produced).
    last_assistant = max(i for i, m in enumerate(result.messages) if m["role"] == "assistant")
    full = canonical(tok, result.messages[: last_assistant + 1], xml)
    assert full.endswith("<|im_end|>\n")
    assert trace.context == tok.encode(full[:-1], add_special_tokens=False)

    # Masks and logprobs: 1 and the sampler's values on sampled tokens, 0 elsewhere.
    assert len(trace.ids) == len(trace.mask) == len(trace.logprobs)
    assert sum(trace.mask) == sum(sampled_lens)
    pos = 0
    runs = []
    while pos < len(trace.mask):
        end = pos
        while end < len(trace.mask) and trace.mask[end] == trace.mask[pos]:
            end += 1
        runs.append((trace.mask[pos], end - pos, pos))
        pos = end
    assert [(m, n) for m, n, _ in runs] == [
        (1, sampled_lens[0]), (0, runs[1][1]), (1, sampled_lens[1]), (0, runs[3][1]),
        (1, sampled_lens[2]), (0, runs[5][1]), (1, sampled_lens[3]),
    ]
    for turn, (m, n, start) in enumerate(r for r in runs if r[0] == 1):
        assert trace.logprobs[start : start + n] == [-(turn + 1 + i / 1000) for i in range(n)]
    for m, n, start in (r for r in runs if r[0] == 0):
        assert trace.logprobs[start : start + n] == [0.0] * n
        # Each inserted chunk starts right after <|im_end|> and ends with the generation prompt.
        chunk = tok.decode(trace.ids[start : start + n], skip_special_tokens=False)
        assert chunk.startswith("\n<|im_start|>user\n")
        assert chunk.endswith("<|im_start|>assistant\n<think>\n" if xml else "<|im_start|>assistant\n")
    assert trace.turn_versions == [1, 2, 3, 4]
    # Thinking stays in the assistant content; the format-error turn kept its text.
    assert result.messages[4]["content"].endswith("I am not sure what to do.")
    assert "A=1" in result.messages[7]["content"]


def test_per_turn_budget_and_overflow(base_tokenizer, box):
    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)
    texts = [hermes_call("echo one"), hermes_call("echo two"), hermes_call("echo three")]
    sampler = ScriptedSampler(tok, texts)
    probe = TokenPolicy(ScriptedSampler(tok, []), tok)
    prompt_len = len(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": "x"}], tools=TOOLS, tokenize=False), add_special_tokens=False))
    assert prompt_len > 0 and probe.end_of_turn == "<|im_end|>"

    policy = TokenPolicy(sampler, tok, max_response_tokens=120, max_context_tokens=10**6, max_turn_tokens=50)
    result = Agent(policy, box, AgentSettings()).run("Count.")
    trace = policy.trace
    # Turn 1: capped by the per-turn limit; later turns by what is left of the response budget.
    assert sampler.calls[0]["max_tokens"] == 50
    for c in sampler.calls[1:]:
        used = len(c["prompt_ids"]) - len(trace.prompt_ids)
        assert c["max_tokens"] == max(1, min(120 - used, 50))
    assert result.status == "context_overflow"
    assert len(trace.ids) <= 120
    assert "budget" in (result.error or "")


def test_context_limit_counts_the_prompt(base_tokenizer, box):
    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)
    sampler = ScriptedSampler(tok, [hermes_call("echo one")] * 2 + [hermes_call(f"echo {SUBMIT_MARKER}")])
    first = TokenPolicy(ScriptedSampler(tok, [hermes_call("x")]), tok)
    first.complete([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], TOOLS)
    policy = TokenPolicy(sampler, tok, max_response_tokens=10**6, max_context_tokens=len(first.trace.prompt_ids) + 5000)
    assert Agent(policy, box, AgentSettings()).run("Count.").status == "submitted"
    assert len(sampler.calls) == 3
    for c in sampler.calls:
        assert c["max_tokens"] == min(16384, policy.max_context_tokens - len(c["prompt_ids"]))


def test_cut_turn_is_closed_with_end_of_turn(base_tokenizer, box):
    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)
    long_text = "THOUGHT: " + "very long thinking " * 40
    sampler = ScriptedSampler(tok, [(long_text, False), hermes_call(f"echo {SUBMIT_MARKER}")])
    policy = TokenPolicy(sampler, tok)
    result = Agent(policy, box, AgentSettings()).run("Go.")
    assert result.status == "submitted" and result.steps == 2
    trace = policy.trace
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    n = len(tok.encode(long_text, add_special_tokens=False))
    assert trace.mask[:n] == [1] * n and trace.ids[n - 1] != eot
    # The template's <|im_end|> closes the cut turn, as an untrained (mask 0) token.
    assert trace.ids[n] == eot and trace.mask[n] == 0 and trace.logprobs[n] == 0.0
    assert tok.decode(trace.ids[n:n + 8], skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user")


def test_first_turn_overflow_raises(base_tokenizer):
    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)
    policy = TokenPolicy(ScriptedSampler(tok, ["x"]), tok, max_context_tokens=10)
    with pytest.raises(ContextOverflow):
        policy.complete([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], TOOLS)


def test_records_include_tokens(base_tokenizer, box, tmp_path):
    from tmax.agents.recorder import Recorder, load_run

    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)
    policy = TokenPolicy(ScriptedSampler(tok, [hermes_call(f"echo {SUBMIT_MARKER}")]), tok)
    Agent(policy, box, AgentSettings(), recorder=Recorder(tmp_path / "r")).run("Go.")
    saved = load_run(tmp_path / "r")
    assert saved.trace == policy.trace and saved.trace.mask.count(1) > 0


def test_failed_sample_is_retried_on_the_same_context(base_tokenizer, box):
    # An engine hiccup (ModelError) on a later turn: the Agent retries, and the retry must
    # sample from exactly the context the failed call prepared, observation added once.
    from tmax.agents.policy import ModelError

    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)

    class Flaky(ScriptedSampler):
        failed = False

        def sample(self, prompt_ids, *a, **kw):
            if len(self.calls) == 1 and not self.failed:
                self.failed = True
                raise ModelError("engine restarting")
            return super().sample(prompt_ids, *a, **kw)

    sampler = Flaky(tok, [hermes_call("echo one"), hermes_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    policy = TokenPolicy(sampler, tok)
    result = Agent(policy, box, AgentSettings(), sleep=lambda s: None).run("Count.")
    assert result.status == "submitted" and sampler.failed
    trace = policy.trace
    last_assistant = max(i for i, m in enumerate(result.messages) if m["role"] == "assistant")
    full = canonical(tok, result.messages[: last_assistant + 1])
    assert trace.context == tok.encode(full[:-1], add_special_tokens=False)
    assert sampler.calls[1]["prompt_ids"] == trace.context[: len(sampler.calls[1]["prompt_ids"])]


def test_a_compacted_session_is_token_segments_exactly_as_sampled(base_tokenizer, box):
    """After a compaction the trace is cut: each segment's prompt ids are its context as
    rendered and sent, its sampled ids those the sampler returned; the summary is in neither.
    The request is counted before it is sent: the long output of turn 1 puts the next one
    over the threshold, so the session compacts before turn 2 (not after it)."""
    from token_spans import spans

    tok = tokenizer_with(base_tokenizer, HERMES_TEMPLATE)
    texts = [hermes_call("python3 -c \"print(' '.join(str(i) for i in range(600)))\""), "SUMMARY: printed a lot.",
             hermes_call("echo two"), hermes_call(f"echo {SUBMIT_MARKER}")]
    probe = ScriptedSampler(tok, texts[:1] + texts[2:])
    Agent(TokenPolicy(probe, tok), box, AgentSettings()).run("Print.")
    # The request after turn 1 and its output, as counted: at 95 % of the window.
    request = len(probe.calls[1]["prompt_ids"])
    sampler = ScriptedSampler(tok, texts)
    policy = TokenPolicy(sampler, tok, max_response_tokens=10**6, max_context_tokens=10**6)
    settings = AgentSettings(compaction=True, compaction_threshold=0.9, context_budget=int(request / 0.95))
    agent = Agent(policy, box, settings)
    result = agent.run("Print.")
    assert result.status == "submitted" and len(sampler.calls) == 4
    (record,) = agent.context.compactions
    assert record.ok and record.step == 1 and record.kept_turns == 0 and not record.estimated
    (first,), second = policy.segments, policy.trace

    # Segment 1: the task and turn 1, as the sampler saw it.
    assert first.prompt_ids == sampler.calls[0]["prompt_ids"]
    assert [first.ids[s:e] for v, s, e in spans(first.mask) if v == 1] == [
        tok.encode(texts[0], add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]]
    # The summary was sampled on a request of its own (the summary prompt last), recorded nowhere.
    assert "Print." in tok.decode(sampler.calls[1]["prompt_ids"]) and "four headings" in tok.decode(sampler.calls[1]["prompt_ids"])
    # Segment 2: the rebuilt context rendered as a prompt, exactly what was sent.
    rebuilt = result.messages[: record.prefix]
    assert "SUMMARY: printed a lot." in rebuilt[1]["content"] and "Print." in rebuilt[1]["content"]
    prompt = tok.apply_chat_template(rebuilt, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert second.prompt_ids == tok.encode(prompt, add_special_tokens=False) == sampler.calls[2]["prompt_ids"]
    assert record.tokens_after == len(second.prompt_ids)
    assert [second.ids[s:e] for v, s, e in spans(second.mask) if v == 1] == [
        tok.encode(t, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")] for t in texts[2:]]
    assert second.turn_versions == [3, 4] and first.turn_versions == [1]
