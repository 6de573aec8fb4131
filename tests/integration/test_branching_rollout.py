"""Branching episodes (`training.branching.run_tree`) through the real loop: real sandboxes
forked at a branch point, the real verifier on each branch, a real tokenizer.

The sampler is scripted per branch (by the seed each branch samples with), so what each
branch does is known: the trunk plays the oracle's first turns, then one branch finishes the
oracle (it can only solve if the fork carried the trunk's files and shell state) and its
sibling submits at once (reward 0)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from long_world import long_world

from token_spans import spans as _spans

from tmax.agents.policy import SampledTokens
from tmax.training.config import preset
from tmax.training.demos import scripted_turns
from tmax.training.rollout import EpisodeRequest, EpisodeSettings, InfraError


@pytest.fixture(scope="module")
def long_tasks(tmp_path_factory):
    return long_world(tmp_path_factory.mktemp("nano-long"), 8, 4)


class BranchScript:
    """A TokenSampler: the trunk (the request's seed) plays `trunk`; each new seed (a branch)
    takes the next script of `branches` (a list: whatever its fork; a dict: by the model turns
    done before it, counted by the end-of-turn tokens of its context), in the order the
    branches first sample."""

    def __init__(self, root_seed: int, trunk: list[list[int]], branches, end_of_turn: int | None = None):
        self.scripts = {root_seed: list(trunk)}
        self.waiting = branches if isinstance(branches, dict) else {None: branches}
        self.end_of_turn, self.prompt_ends = end_of_turn, None
        self.taken: dict[int, int] = {}  # seed -> the order it first sampled in
        self.contexts: dict[int, list[list[int]]] = {}
        self.lock = threading.Lock()

    def sample(self, prompt_ids, max_tokens, temperature, top_p, seed=None) -> SampledTokens:
        with self.lock:
            ends = list(prompt_ids).count(self.end_of_turn)
            if self.prompt_ends is None:
                self.prompt_ends = ends  # the trunk's first sample: the prompt alone
            if seed not in self.scripts:
                self.taken[seed] = len(self.taken)
                # A turn and its output each close with an end-of-turn token.
                level = (ends - self.prompt_ends) // 2 if self.end_of_turn is not None else None
                self.scripts[seed] = list(self.waiting[level].pop(0))
            self.contexts.setdefault(seed, []).append(list(prompt_ids))
            ids = self.scripts[seed].pop(0)
        return SampledTokens(ids, [-0.1] * len(ids), "stop", 3)


def _settings(kind: str, **branching) -> EpisodeSettings:
    cfg = preset("nano-long")
    cfg.rollout.sandbox = kind
    cfg.rollout.branching = cfg.rollout.branching.model_copy(update={"enabled": True, **branching})
    return EpisodeSettings.of(cfg.rollout)


def _chain(splits):
    from tmax.common.records import NanoMeta

    return max((d for d in splits["train"]), key=lambda d: NanoMeta.read(d).depth)


@pytest.mark.parametrize("kind", ["local", pytest.param("bwrap", marks=pytest.mark.bwrap)])
def test_a_forked_episode_continues_each_branch_from_the_same_state_and_tokens(long_tasks, kind):
    if kind == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    from tmax.training.branching import run_tree
    from tmax.training.nano.tasks import oracle_steps

    tok, splits = long_tasks
    task = _chain(splits)
    oracle = scripted_turns(tok, oracle_steps(task))
    assert len(oracle) >= 4
    quit_now = scripted_turns(tok, [oracle_steps(task)[-1]])  # the submit, nothing written
    sampler = BranchScript(11, oracle[:2], [oracle[2:], quit_now])
    settings = _settings(kind, at_turns=[2], branches=2)
    out = run_tree(EpisodeRequest(str(task), 5, 1, 11), sampler, tok, settings, settings.branching, start_version=3)

    leaves = out.leaves
    assert not out.branch_failures and len(leaves) == 2
    assert [r.branch_path for r in leaves] == [[0], [1]] and all(r.branch_turns == [2] for r in leaves)
    by_script = {sampler.taken[seed]: r for seed, r in zip(sorted(sampler.taken), leaves)}
    rewards = sorted(r.reward for r in leaves)
    assert rewards == [0.0, 1.0], [(r.status, r.reward, r.error) for r in leaves]
    solved = next(r for r in leaves if r.reward == 1.0)
    quit_ = next(r for r in leaves if r.reward == 0.0)
    # The solving branch ran the rest of the oracle after the fork, on the trunk's state.
    assert solved.steps == len(oracle) and quit_.steps == 3 and solved.status == quit_.status == "submitted"
    # Token-in/token-out: both branches' ids are the trunk's up to the fork, exactly, and the
    # first sample of each branch saw the same context (the trunk's, plus turn 2's output).
    at = solved.branch_at[0]
    assert at == quit_.branch_at[0] and solved.trace.prompt_ids == quit_.trace.prompt_ids
    assert solved.trace.ids[:at] == quit_.trace.ids[:at]
    sampled = [solved.trace.ids[s:e] for v, s, e in _spans(solved.trace.mask) if v == 1]
    assert sampled == oracle
    first = [sampler.contexts[seed][0] for seed in sampler.taken]
    assert first[0] == first[1] and first[0][: len(solved.trace.prompt_ids) + at] == solved.trace.context[: len(solved.trace.prompt_ids) + at]
    assert all(r.turn_outcomes[:2] == ["ok", "ok"] for r in leaves) and all(r.fork_s[0] > 0 for r in leaves)
    assert all(r.group_id == 5 and r.sample_index == 1 and r.policy_version == 3 for r in leaves)
    assert len(by_script) == 2


def test_a_branch_whose_sandbox_dies_is_labelled_and_left_out(long_tasks):
    """One branch removes its working directory and kills its shell, which then cannot restart:
    that branch is a labelled failure, its sibling a leaf; when every branch dies so the
    episode is an infrastructure error."""
    from tmax.training.branching import run_tree
    from tmax.training.nano.tasks import oracle_steps

    tok, splits = long_tasks
    task = _chain(splits)
    oracle = scripted_turns(tok, oracle_steps(task))
    die = scripted_turns(tok, [("THOUGHT: end it.", 'd=$(pwd); cd /; rm -rf "$d"; kill -9 $$')])
    settings = _settings("local", at_turns=[1], branches=2)
    sampler = BranchScript(4, oracle[:1], [oracle[1:], die + die + die])
    out = run_tree(EpisodeRequest(str(task), 0, 0, 4), sampler, tok, settings, settings.branching)
    assert len(out.leaves) == 1 and out.leaves[0].reward == 1.0
    assert [(f.kind, f.branch_path in ([0], [1])) for f in out.branch_failures] == [("sandbox_died", True)]

    sampler = BranchScript(4, oracle[:1], [die * 3, die * 3])
    with pytest.raises(InfraError, match="every branch failed") as e:
        run_tree(EpisodeRequest(str(task), 0, 0, 4), sampler, tok, settings, settings.branching)
    assert e.value.kind == "sandbox_died"


@pytest.mark.podman
def test_branches_of_a_podman_overlay_episode_run_in_forks_of_its_overlay(long_tasks, base_image, tmp_path):
    """The same tree on podman: the episode an overlay of a shared container, each branch an
    overlay forked from it in the same container, each scored by its own verifier; nothing of
    the run's containers is left."""
    import uuid

    from tmax.sandbox.cleanup import remove_labelled
    from tmax.sandbox.overlay_pool import OverlayPool
    from tmax.training.branching import run_tree
    from tmax.training.nano.tasks import oracle_steps
    from tmax.training.rollout import prepare_tasks

    tok, splits = long_tasks
    task = _chain(splits)
    oracle = scripted_turns(tok, oracle_steps(task))
    quit_now = scripted_turns(tok, [oracle_steps(task)[-1]])
    settings = _settings("podman", at_turns=[2], branches=2)
    image = prepare_tasks(settings.env, [str(task)], log=lambda m: None).images[str(task)]
    label = {"io.tmax.test": uuid.uuid4().hex[:12]}
    hosts = Path(tempfile.mkdtemp(prefix="tb-"))  # short: the episodes' sockets live under it

    def tree(slots: int, trunk: int = 2):
        with OverlayPool(slots, host_labels=label, root=hosts, close_in_background=False) as pool:
            sampler = BranchScript(11, oracle[:trunk], [oracle[2:], quit_now])
            done = run_tree(EpisodeRequest(str(task), 0, 0, 11), sampler, tok, settings, settings.branching,
                            image=image, pool=pool)
        # Every fork's sandbox was closed, and the pool's container with it: nothing left.
        assert subprocess.run(["podman", "ps", "-aq", "--filter", f"label=io.tmax.test={label['io.tmax.test']}"],
                              capture_output=True, text=True).stdout.split() == []
        return done

    try:
        out = tree(settings.branching.sandboxes_at_once)  # the room a rollout worker gives each episode
        # A host with room for the parent and one child: the second fork fails, labelled, and
        # the branch that exists goes on.
        short = tree(2)
        # No room for any child: both forks fail (labelled), and the episode goes on unforked.
        alone = tree(1, trunk=len(oracle))
    finally:
        remove_labelled(label)
        shutil.rmtree(hosts, ignore_errors=True)
    assert not out.branch_failures and sorted(r.reward for r in out.leaves) == [0.0, 1.0]
    a, b = out.leaves
    assert a.sandbox_mode.startswith("overlay") and a.container_id == b.container_id
    assert a.trace.ids[: a.branch_at[0]] == b.trace.ids[: b.branch_at[0]]
    assert [(f.kind, f.branch_path) for f in short.branch_failures] == [("fork", [1])]
    assert "full" in short.branch_failures[0].error and [r.branch_path for r in short.leaves] == [[0]]
    assert [(f.kind, f.branch_path) for f in alone.branch_failures] == [("fork", [0]), ("fork", [1])]
    [unforked] = alone.leaves
    assert unforked.branch_path == [] and unforked.steps == len(oracle) and unforked.reward == 1.0


def test_two_branch_points_make_a_tree_of_four_leaves(long_tasks):
    from tmax.training.branching import run_tree
    from tmax.training.nano.tasks import oracle_steps

    tok, splits = long_tasks
    task = _chain(splits)
    oracle = scripted_turns(tok, oracle_steps(task))
    quit_now = scripted_turns(tok, [oracle_steps(task)[-1]])
    # After turn 1: two branches that play one turn and fork again; after turn 2, the four leaves.
    sampler = BranchScript(2, oracle[:1], {1: [oracle[1:2], oracle[1:2]], 2: [oracle[2:], quit_now] * 2},
                           end_of_turn=tok.convert_tokens_to_ids("<|im_end|>"))
    settings = _settings("local", at_turns=[1, 2], branches=2)
    out = run_tree(EpisodeRequest(str(task), 0, 0, 2), sampler, tok, settings, settings.branching)
    assert not out.branch_failures
    leaves = out.leaves
    assert [r.branch_path for r in leaves] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert all(r.branch_turns == [1, 2] for r in leaves) and sorted(r.reward for r in leaves) == [0, 0, 1, 1]
    first, second = leaves[0].branch_at
    assert all(r.trace.ids[:first] == leaves[0].trace.ids[:first] for r in leaves)
    for a, b in ((leaves[0], leaves[1]), (leaves[2], leaves[3])):
        assert a.branch_at == b.branch_at and a.trace.ids[: a.branch_at[1]] == b.trace.ids[: b.branch_at[1]]
    assert second > first
