"""Long-horizon nano tasks through the real episode: the oracle's and the sloppy teacher's
turns played through the harness in real sandboxes (local, bwrap, podman), scored by the
tasks' own verifier, and the agentic measures of those episodes (turns, where failed
commands fall, the step budget).

The sampler is scripted (pre-rendered turns of the oracle or the teacher); everything else
is what a rollout runs."""

from __future__ import annotations

import random
import shutil

import pytest

from long_world import long_world

from tmax.training.agentic import agentic_metrics, of_rollout
from tmax.training.config import preset
from tmax.training.demos import oracle_demo, play_demo
from tmax.training.rollout import EpisodeSettings, prepare_tasks


@pytest.fixture(scope="module")
def long_tasks(tmp_path_factory):
    # 12 held-out tasks: every kind at each of its depths (round-robin kinds, drawn depths).
    return long_world(tmp_path_factory.mktemp("nano-long"), 8, 12)


def _episode(kind: str, **rollout) -> EpisodeSettings:
    cfg = preset("nano-long")
    cfg.rollout.sandbox = kind
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return EpisodeSettings.of(cfg.rollout)


@pytest.mark.parametrize("kind", ["local", pytest.param("bwrap", marks=pytest.mark.bwrap)])
def test_oracle_solves_every_generated_task_through_the_verifier(long_tasks, kind):
    if kind == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    tok, splits = long_tasks
    ep = _episode(kind)
    rollouts = [oracle_demo(d, tok, ep) for d in splits["train"] + splits["heldout"]]  # raises unless reward 1
    from tmax.common.records import NanoMeta

    depths = [NanoMeta.read(d).depth for d in splits["train"] + splits["heldout"]]
    assert {3, 5} <= set(depths) <= {3, 4, 5}
    for r, depth in zip(rollouts, depths):
        assert r.status == "submitted" and r.reward == 1.0
        assert r.steps == depth + 1 == len(r.turn_outcomes) and set(r.turn_outcomes) == {"ok"}
    m = agentic_metrics([of_rollout(r) for r in rollouts])
    assert m["agentic/turns_solved"] == sum(depths) / len(depths) + 1 >= 4
    assert m["agentic/max_steps_rate"] == 0.0 and m["agentic/failed_commands_per_episode"] == 0.0


@pytest.mark.podman
def test_oracle_solves_tasks_in_podman(long_tasks, base_image, tmp_path):
    tok, splits = long_tasks
    ep = _episode("podman", overlay=False)
    dirs = [str(d) for d in splits["heldout"][:4]]  # one of each kind
    prepared = prepare_tasks(ep.env, dirs, tmp_path / "report.json", log=lambda m: None)
    for d in dirs:
        r = oracle_demo(d, tok, ep, image=prepared.images[d])
        assert r.reward == 1.0 and r.sandbox == "podman"


def test_teacher_episodes_show_where_mistakes_fall_and_the_step_budget(long_tasks):
    """The sloppy teacher's episodes: solved exactly when its steps are right; a wrong path
    read fails its command, and that failure is placed in its third of the episode. An
    episode cut by `max_steps` ends on the step budget."""
    from tmax.common.records import NanoMeta
    from tmax.training.nano.tasks import teacher_steps

    tok, splits = long_tasks
    ep = _episode("local")
    rng = random.Random(3)
    for d in splits["train"]:
        steps, right = teacher_steps(d, 0.5, rng)
        assert (play_demo(d, steps, tok, ep).reward == 1.0) == right
    # The longest chain task, its second command reading a note that is not there: a failed
    # command in the first third of a 5- or 6-turn episode (turn 1).
    chain = max((d for d in splits["train"] + splits["heldout"] if NanoMeta.read(d).kind == "chain"),
                key=lambda d: NanoMeta.read(d).depth)
    meta = NanoMeta.read(chain)
    assert meta.depth >= 4
    steps = [("THOUGHT: Read.", c) for c in meta.commands]
    steps[1] = ("THOUGHT: Read.", "cat nosuchnote.txt")
    r = play_demo(chain, steps + [("THOUGHT: Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")], tok, ep)
    assert r.turn_outcomes == ["ok", "failed"] + ["ok"] * (meta.depth - 1)
    m = agentic_metrics([of_rollout(r)])
    assert m["agentic/failed_commands_per_episode"] == 1.0 and m["agentic/failed_commands_early"] == 1.0
    # Cut by the step budget: 3 turns of a 5- or 6-command plan, no submit.
    short = _episode("local", max_steps=3)
    r = play_demo(chain, steps, tok, short)
    assert r.status == "max_steps" and r.steps == 3 and r.reward == 0.0
    assert agentic_metrics([of_rollout(r)])["agentic/max_steps_rate"] == 1.0
