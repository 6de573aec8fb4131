"""Token-exact training under another harness: a nano rollout under mini-swe (the action is a
fenced bash block in plain text, no tool call) yields the same kind of trace as Vanillux2 —
sampled spans verbatim with their logprobs (mask 1), observations as template tokens (mask 0,
logprob 0) — and the trace is the chat template's rendering of the conversation, under
mini-swe and terminus-2 (JSON keystrokes in a tmux session) alike."""

from __future__ import annotations

import shutil

import pytest

from tmax.agents.policy import SampledTokens
from token_spans import spans as _spans
from tmax.training.config import RolloutConfig, preset
from tmax.training.demos import scripted_turns
from tmax.training.rollout import EpisodeRequest, EpisodeSettings, run_episode


class LogprobSampler:
    """Scripted turns with distinct, recognisable logprobs per token."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)
        self.given: list[list[float]] = []

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None) -> SampledTokens:
        ids = self.turns.pop(0)
        lps = [-0.001 * (len(self.given) + 1) * (i + 1) for i in range(len(ids))]
        self.given.append(lps)
        return SampledTokens(ids, lps, "stop", 0)


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("nano-harness")
    build_tokenizer(0).save_pretrained(root / "tok")
    splits = write_splits(root / "tasks", 6, 2, seed=0)
    return AutoTokenizer.from_pretrained(root / "tok"), splits


def test_harness_rotates_per_group():
    cfg = RolloutConfig(harness=["tmax", "mini-swe", "terminus-2"])
    assert [cfg.harness_for(g) for g in range(4)] == ["tmax", "mini-swe", "terminus-2", "tmax"]
    with pytest.raises(ValueError, match="rollout.harness"):
        RolloutConfig(harness="openhands")


def test_mini_swe_rollout_token_trace(nano):
    from tmax.training.nano.tasks import oracle_steps

    tok, splits = nano
    task = splits["train"][1]
    turns = scripted_turns(tok, oracle_steps(task), "mini-swe")
    cfg = preset("nano").rollout
    cfg.sandbox, cfg.harness = "local", ["tmax", "mini-swe"]
    sampler = LogprobSampler(turns)
    r = run_episode(EpisodeRequest(str(task), 1, 0, 3), sampler, tok, EpisodeSettings.of(cfg))  # group 1: mini-swe
    assert r.harness == "mini-swe"
    assert r.status == "submitted" and r.reward == 1.0
    assert len(r.trace.ids) == len(r.trace.logprobs) == len(r.trace.mask)
    sampled = [(s, e) for v, s, e in _spans(r.trace.mask) if v == 1]
    assert [r.trace.ids[s:e] for s, e in sampled] == turns
    assert [r.trace.logprobs[s:e] for s, e in sampled] == sampler.given
    for v, s, e in _spans(r.trace.mask):
        if v == 0:
            assert all(lp == 0.0 for lp in r.trace.logprobs[s:e])
            text = tok.decode(r.trace.ids[s:e], skip_special_tokens=False)
            # A plain user message (no tool role, no tools in the prompt) with the observation.
            assert "<|im_start|>user" in text and "<returncode>0</returncode>" in text
            assert text.rstrip().endswith("<|im_start|>assistant")
    prompt = tok.decode(r.trace.prompt_ids, skip_special_tokens=False)
    assert "```bash" in prompt and "<tools>" not in prompt


@pytest.mark.parametrize("harness", ["mini-swe", pytest.param("terminus-2", marks=pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed"))])
def test_trace_is_the_template_rendering(nano, harness):
    """What training sees equals the chat template's rendering of the whole conversation."""
    from tmax.agents.harnesses import make_harness
    from tmax.agents.loop import Agent
    from tmax.agents.agent_settings import AgentSettings
    from tmax.agents.token_policy import TokenPolicy
    from tmax.tasks.task_format import Task
    from tmax.training.nano.tasks import oracle_steps
    from tmax.tasks.episode import EnvSettings, Episode

    tok, splits = nano
    task_dir = splits["train"][2]
    task = Task.load(task_dir)
    ep = Episode(task, EnvSettings(kind="local"))
    try:
        sandbox = ep.open()
        turns = scripted_turns(tok, oracle_steps(task_dir), harness)
        policy = TokenPolicy(LogprobSampler(turns), tok, temperature=1.0, top_p=1.0)
        agent = Agent(policy, sandbox, AgentSettings(max_steps=6, max_format_errors=1),
                      harness=make_harness(harness, ep.workdir))
        try:
            res = agent.run(task.instruction)
        finally:
            agent.harness.close()
    finally:
        ep.close()
    assert res.status == "submitted"
    # The trace ends with the submit turn's end of turn; its observation is never sampled on.
    msgs = [dict(m) for m in res.messages][:-1]
    assert msgs[-1]["role"] == "assistant" and all("tool_calls" not in m for m in msgs)
    full = tok.encode(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)
    ctx = policy.trace.context
    assert full[: len(ctx)] == ctx
    assert tok.decode(full[len(ctx):]) == "\n"
