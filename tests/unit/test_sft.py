"""SFT warm start: oracle demonstrations through the harness (`training.demos`), turn by turn.
Training on them (real torch steps, `tmax learn sft`) is in tests/integration/test_sft_training.py."""

from __future__ import annotations

import pytest

from tiny_learner import small_nano
from tmax.agents.harnesses import HARNESSES
from token_spans import spans as _spans
from tmax.training.config import preset
from tmax.training.demos import (
    DemoError, ScriptedSampler, collect_demos, oracle_demo, scripted_turns, select_sft_tasks,
)
from tmax.training.learner.sft import train_sft
from tmax.training.rollout import EpisodeSettings


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    return small_nano(tmp_path_factory.mktemp("sft"))


def test_assistant_turn_is_the_template_rendering(nano):
    tok, _, _ = nano
    [ids] = scripted_turns(tok, [("THOUGHT: Sort the lines.", "sort a.txt > b.txt")])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("THOUGHT: Sort the lines.\n<tool_call>\n")
    assert '"command": "sort a.txt > b.txt"' in text and text.endswith("</tool_call><|im_end|>")


def test_scripted_sampler_respects_turn_budget(nano):
    tok, _, _ = nano
    [ids] = scripted_turns(tok, [("THOUGHT: x.", "ls")])
    with pytest.raises(DemoError, match="per-turn budget"):
        ScriptedSampler([ids]).sample([1], len(ids) - 1, 1.0, 1.0)


@pytest.mark.parametrize("harness", HARNESSES)
def test_oracle_demo_under_each_harness(nano, harness):
    """A demonstration is written as the harness's model would write it (terminus-2: JSON
    keystrokes, and the confirming second `task_complete`), scores 1, and its trace holds
    those turns verbatim as the sampled spans; the rest is the template's observations."""
    from tmax.training.nano.tasks import oracle_steps

    tok, splits, _ = nano
    cfg = preset("nano")
    cfg.rollout.harness = harness
    # Terminus-2's JSON turns and screens take more tokens than the nano preset allows.
    cfg.rollout.max_tokens, cfg.rollout.response_budget, cfg.rollout.context_budget = 128, 1024, 2048
    task = splits["train"][0]
    r = oracle_demo(task, tok, EpisodeSettings.of(cfg.rollout))
    assert (r.harness, r.status, r.reward) == (harness, "submitted", 1.0)
    turns = scripted_turns(tok, oracle_steps(task), harness)
    assert len(turns) == len(oracle_steps(task)) + (harness == "terminus-2")
    spans = _spans(r.trace.mask)
    assert [r.trace.ids[s:e] for v, s, e in spans if v == 1] == turns
    assert r.trace.logprobs == [0.0] * len(r.trace.ids)
    for v, s, e in spans:
        if v == 0:
            text = tok.decode(r.trace.ids[s:e], skip_special_tokens=False)
            assert text.startswith("\n<|im_start|>") and text.endswith("<|im_start|>assistant\n")


def test_partial_task_selection_is_seeded(nano):
    _, splits, _ = nano
    dirs = [str(p) for p in splits["train"]]
    a = select_sft_tasks(dirs, 0.5, 1)
    assert a == select_sft_tasks(dirs, 0.5, 1) and len(a) == 3 and set(a) <= set(dirs)


def test_teacher_demos_keep_their_failures_and_are_seeded(nano):
    """Below accuracy 1 the demonstrations are played by the sloppy teacher: its failed
    episodes are kept (scored 0 by the real verifier), and the choice is reproducible."""
    tok, splits, root = nano
    cfg = preset("nano")
    cfg.sft.teacher_accuracy = 0.5
    dirs = [str(p) for p in splits["train"]]
    a = collect_demos(dirs, tok, cfg)
    b = collect_demos(dirs, tok, cfg)
    assert [r.reward for r in a] == [r.reward for r in b] and [r.ids for r in a] == [r.ids for r in b]
    assert {r.reward for r in a} == {0.0, 1.0}, [r.reward for r in a]  # seed 0 draws both with 6 tasks
    assert all(r.status == "submitted" for r in a)


def test_sft_threads_leave_the_cores_other_processes_keep_busy():
    """`CoreShare` counts what other processes used since its last look: with a process
    burning a core beside it, at most the other cores are free (the busy one's share never
    goes to a torch thread that would wait at every barrier); never fewer than one."""
    import os
    import subprocess
    import sys
    import time

    from tmax.training.learner.sft import CoreShare

    cores = len(os.sched_getaffinity(0))
    share = CoreShare()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 1.5: pass\n"], check=True)
    assert 1 <= share.free_cores() <= max(1, cores - 1)
    t = time.monotonic()
    assert 1 <= share.free_cores(min_window_s=0.5) <= cores
    assert time.monotonic() - t >= 0.5  # a look right after the last waited for a window to measure
