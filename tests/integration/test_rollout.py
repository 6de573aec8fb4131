"""Training episodes through the real loop: real sandboxes, real verifier, real tokenizer.

The sampler is scripted (pre-rendered assistant turns), so token alignment, masks,
budgets and terminations can be checked exactly; the model is irrelevant here."""

from __future__ import annotations

import shutil

import pytest

from token_spans import spans as _spans

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.training.config import preset
from tmax.training.rollout import EpisodeRequest, EpisodeSettings, InfraError, run_episode
from tmax.training.demos import ScriptedSampler, scripted_turns


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("nano")
    tok = build_tokenizer(0)
    tok.save_pretrained(root / "tok")
    splits = write_splits(root / "tasks", 10, 2, seed=0)
    return AutoTokenizer.from_pretrained(root / "tok"), splits, root


def _cfg(kind="local", **rollout):
    cfg = preset("nano")
    cfg.rollout.sandbox = kind
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return EpisodeSettings.of(cfg.rollout)


def _oracle_turns(tok, task_dir):
    from tmax.training.nano.tasks import oracle_steps

    return scripted_turns(tok, oracle_steps(task_dir))


@pytest.mark.parametrize("kind", ["local", pytest.param("bwrap", marks=pytest.mark.bwrap)])
def test_oracle_episode_tokens_align_and_score(nano, kind):
    if kind == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    tok, splits, root = nano
    task = splits["train"][1]
    turns = _oracle_turns(tok, task)
    r = run_episode(EpisodeRequest(str(task), 0, 0, 7), ScriptedSampler(turns), tok, _cfg(kind))
    assert r.status == "submitted" and r.submitted and r.reward == 1.0
    assert len(r.trace.ids) == len(r.trace.logprobs) == len(r.trace.mask)
    # Sampled spans are exactly the scripted turns, in order; everything between is mask 0
    # with logprob 0 and is the template's rendering of a tool observation.
    sampled = [(s, e) for v, s, e in _spans(r.trace.mask) if v == 1]
    assert [r.trace.ids[s:e] for s, e in sampled] == turns
    for v, s, e in _spans(r.trace.mask):
        if v == 0:
            assert all(lp == 0.0 for lp in r.trace.logprobs[s:e])
            text = tok.decode(r.trace.ids[s:e], skip_special_tokens=False)
            assert "<tool_response>" in text and text.rstrip().endswith("<|im_start|>assistant")
    # The whole context is what the chat template renders for the same conversation:
    # training sees what deployment (which re-renders) would see.
    assert r.trace.prompt_ids[:3] == tok.encode("<|im_start|>system\n", add_special_tokens=False)[:3]


def test_an_episode_with_compaction_on_is_one_sample_per_segment(nano):
    """`[rollout] compaction = true`: an episode that crosses the threshold is two token
    segments, each exactly as sampled (the summary in neither), trained with the reward."""
    from tmax.agents.harnesses import make_harness
    from tmax.agents.tools import TOOLS
    from tmax.training.algo.batching import Group
    from tmax.training.learner.packing import batch_samples
    from tmax.training.demos import assistant_ids
    from tmax.training.rollout import Rollout

    tok, splits, root = nano
    task = splits["train"][1]
    big = "python3 -c \"print('a' * 2000)\""
    before = scripted_turns(tok, [("THOUGHT: look first.", big)])
    summary = assistant_ids(tok, {"role": "assistant", "content": "SUMMARY: printed a lot, nothing changed."})
    after = scripted_turns(tok, [("THOUGHT: and once more.", "echo ok")]) + _oracle_turns(tok, task)
    prompt = len(tok.apply_chat_template(make_harness("tmax").initial_messages("x"), tools=TOOLS,
                                         add_generation_prompt=True, tokenize=True)["input_ids"])
    obs = len(tok.encode("a" * 2000, add_special_tokens=False))
    # Half the window: the request after the first turn, its big output in it, would pass it, so
    # the episode compacts before that request is sent.
    cfg = _cfg(compaction=True, compaction_threshold=0.5, context_budget=2 * (prompt + obs), response_budget=10**6,
               observation_max_chars=4000)
    r = run_episode(EpisodeRequest(str(task), 0, 0, 7), ScriptedSampler(before + [summary] + after), tok, cfg)
    assert r.status == "submitted" and r.reward == 1.0 and len(r.segments) == 1
    assert [t.ids[s:e] for t in r.traces for v, s, e in _spans(t.mask) if v == 1] == before + after
    assert tok.decode(r.trace.prompt_ids).count("SUMMARY: printed a lot") == 1
    assert r.num_sampled == sum(map(len, before + after))
    again = Rollout.from_json(r.to_json())
    assert again.segments == r.segments and again.trace == r.trace
    samples = batch_samples([Group("t", [1.0], [r])], [[0.5]])
    assert [s.trace for s in samples] == r.traces and {s.advantage for s in samples} == {0.5}


def test_context_matches_full_rerender(nano):
    """The token-in/token-out stream equals the tokenizer's encoding of the chat template's
    rendering of the whole conversation, so `tmax bench` (which re-renders) sees the same."""
    from tmax.agents.loop import Agent
    from tmax.agents.agent_settings import AgentSettings
    from tmax.agents.token_policy import TokenPolicy
    from tmax.agents.tools import TOOLS
    from tmax.tasks.episode import EnvSettings, Episode
    from tmax.tasks.task_format import Task

    tok, splits, root = nano
    task_dir = splits["train"][2]
    task = Task.load(task_dir)
    with Episode(task, EnvSettings("local")) as ep:
        policy = TokenPolicy(ScriptedSampler(_oracle_turns(tok, task_dir)), tok, temperature=1.0, top_p=1.0)
        res = Agent(policy, ep.open(), AgentSettings(max_steps=4, max_format_errors=1)).run(task.instruction)
    assert res.status == "submitted"
    # The trace stops at the last sampled token (the submit turn's end of turn); the
    # re-render of the conversation up to that turn adds only the template's newline.
    msgs = [dict(m) for m in res.messages][:-1]
    assert msgs[-1]["role"] == "assistant"
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    full = tok.encode(text, add_special_tokens=False)
    ctx = policy.trace.context
    assert full[: len(ctx)] == ctx
    assert tok.decode(full[len(ctx):]) == "\n"


def test_format_error_ends_episode_without_verifier(nano):
    tok, splits, root = nano
    bad = tok.encode("I will not call a tool.<|im_end|>", add_special_tokens=False)
    r = run_episode(EpisodeRequest(str(splits["train"][0]), 0, 0, 1), ScriptedSampler([bad]), tok, _cfg())
    assert r.status == "format_errors" and r.reward == 0.0 and not r.submitted
    assert r.verifier is None and r.steps == 1
    assert r.trace.mask == [1] * len(bad)


def test_tool_call_budget_ends_episode_with_zero_reward(nano):
    tok, splits, root = nano
    [turn] = scripted_turns(tok, [("THOUGHT: look.", "ls")])
    r = run_episode(EpisodeRequest(str(splits["train"][0]), 0, 0, 1), ScriptedSampler([turn] * 10), tok,
                    _cfg(max_steps=3))
    assert r.status == "max_steps" and r.steps == 3 and r.reward == 0.0
    assert sum(1 for v, _, _ in _spans(r.trace.mask) if v == 1) == 3


def test_response_budget_counts_tool_tokens_and_keeps_overlong_negative(nano):
    tok, splits, root = nano
    [turn] = scripted_turns(tok, [("THOUGHT: print a lot.", "seq 1 200")])
    budget = len(turn) * 2 + 20  # two turns fit, the long observation does not
    r = run_episode(EpisodeRequest(str(splits["train"][0]), 0, 0, 1), ScriptedSampler([turn] * 10), tok,
                    _cfg(response_budget=budget, max_tokens=len(turn), max_steps=8))
    assert r.status == "context_overflow" and r.truncated and r.reward == 0.0
    assert len(r.trace.ids) <= budget


def test_submit_without_solving_scores_zero(nano):
    tok, splits, root = nano
    [turn] = scripted_turns(tok, [("THOUGHT: done.", SUBMIT_COMMAND)])
    r = run_episode(EpisodeRequest(str(splits["train"][0]), 0, 0, 1), ScriptedSampler([turn]), tok, _cfg())
    assert r.submitted and r.reward == 0.0 and r.verifier["status"] == "ok"


def test_broken_verifier_is_infrastructure_not_reward_zero(nano, tmp_path):
    tok, splits, root = nano
    task = tmp_path / "broken"
    shutil.copytree(splits["train"][0], task)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nexit 3\n")  # writes no reward
    turns = _oracle_turns(tok, splits["train"][0])
    with pytest.raises(InfraError, match="reward") as e:
        run_episode(EpisodeRequest(str(task), 0, 0, 1), ScriptedSampler(turns), tok, _cfg())
    assert e.value.kind == "verifier_no_reward"


@pytest.mark.parametrize("write,kind", [(": >", "verifier_no_reward"), ("echo nan >", "verifier_error")])
def test_verifier_result_kind_sets_the_infra_kind(nano, tmp_path, write, kind):
    """An empty reward file counts as no reward, an unreadable one as a verifier error:
    mapped from the verifier's result kind, not from the words of its message."""
    tok, splits, root = nano
    task = tmp_path / "odd-reward"
    shutil.copytree(splits["train"][0], task)
    (task / "tests" / "test.sh").write_text(f'#!/bin/bash\n{write} "$TMAX_LOGS_DIR/verifier/reward.txt"\n')
    with pytest.raises(InfraError) as e:
        run_episode(EpisodeRequest(str(task), 0, 0, 1), ScriptedSampler(_oracle_turns(tok, splits["train"][0])), tok,
                    _cfg())
    assert e.value.kind == kind


def test_environment_that_cannot_be_made_is_infrastructure(nano, tmp_path):
    tok, splits, root = nano
    task = tmp_path / "needs-podman"
    shutil.copytree(splits["train"][0], task)
    with open(task / "environment" / "Dockerfile", "a") as f:
        f.write("RUN apt-get install -y cowsay\n")  # the host cannot stand in for this image
    with pytest.raises(InfraError, match="needs podman") as e:
        run_episode(EpisodeRequest(str(task), 0, 0, 1), ScriptedSampler([]), tok, _cfg())
    assert e.value.kind == "environment"


def test_tests_are_not_visible_before_submit(nano):
    tok, splits, root = nano
    [look] = scripted_turns(tok, [("THOUGHT: peek.", "ls -a .. ; ls ../tests")])
    r = run_episode(EpisodeRequest(str(splits["train"][0]), 0, 0, 1), ScriptedSampler([look, look]), tok,
                    _cfg(max_steps=2))
    obs = tok.decode([i for i, m in zip(r.trace.ids, r.trace.mask) if m == 0])
    assert "No such file or directory" in obs and "expected.txt" not in obs


def test_infra_errors_are_counted_by_kind():
    from tmax.training.generator import InfraCounts

    counts = InfraCounts()
    counts.add("sandbox_died", "/t/a", "container exited")
    counts.add("sandbox_died", "/t/b", "container exited")
    counts.add("verifier_no_reward", "/t/a", "no reward.txt")
    assert counts.metrics() == {"env/infra_errors": 3.0, "env/infra_errors/sandbox_died": 2.0,
                                "env/infra_errors/verifier_no_reward": 1.0}
    with pytest.raises(ValueError, match="kind"):
        InfraError("flaky", "not a kind the metrics know")
