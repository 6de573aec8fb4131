"""Branching rollouts (`rollout.branching`): one episode forked at fixed turns into a tree.

The episode runs as any other (`training.rollout.run_episode`) until the model turn named by
the next branch point has run and its output came back. Then its sandbox is forked
(`tasks.episode.Episode.fork`: files, working directory, shell state; no replay of commands)
`branches` times, and each child goes on from the same conversation with a copy of the
policy's token context (`TokenPolicy.fork`): every continuation's ids start with the
parent's ids exactly, so the learner's prefix trie computes them once and the engine's
prefix cache serves them. Each child samples with its own seed. The parent's sandbox is
closed once its children exist; the children run side by side, and fork again at the next
branch point. An episode that ends before a branch point is a leaf there.

A failure inside a branch (the fork, the child's sandbox, its verifier) ends that branch
only: it is labelled (`BranchFailure`, its infrastructure kind) and never scored; its
siblings go on. When no leaf is left, or the episode fails before its first fork, the whole
episode is an infrastructure failure, re-queued as any other.

The leaves come back as `Rollout`s with their path (`branch_path`, `branch_turns`,
`branch_at`); the trainer gives each stretch of turns its advantage from the tree
(`training.algo.tree`).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tmax.agents.driver import EpisodeDriver, EpisodeResult
from tmax.agents.loop import Agent, AgentHooks
from tmax.agents.policy import TokenSampler
from tmax.common.records import AgentStatus
from tmax.sandbox.base import CommandResult
from tmax.sandbox.pool import SandboxPool
from tmax.tasks.episode import Episode
from tmax.tasks.task_images import TaskImage
from tmax.training.config import BranchingConfig
from tmax.training.generator import BranchFailure, EpisodeRequest, GeneratedEpisode, Rollout
from tmax.training.rollout import Drive, EpisodeSettings, InfraError, episode_rollout, open_episode, scored

if TYPE_CHECKING:
    from tmax.agents.token_policy import TokenPolicy


class StopAfterTurn(AgentHooks):
    """Stops the loop once model turn `turn` has run and its output came back: the episode's
    state at a branch point (the next model call would start the next turn)."""

    def __init__(self, turn: int | None):
        self.turn = turn
        self.stop: threading.Event | None = None  # the driver's stop, once it exists

    def _after(self, step: int) -> None:
        if self.turn is not None and step >= self.turn and self.stop is not None:
            self.stop.set()

    def on_observation(self, step: int, result: CommandResult, observation: str) -> None:
        self._after(step)

    def on_format_error(self, step: int, feedback: str, reason: str | None = None) -> None:
        self._after(step)


@dataclass
class Branch:
    """One node of the tree as it runs: its episode and where it stands."""

    ep: Episode
    policy: TokenPolicy
    agent: Agent | None  # the conversation it continues (None: the root, from the task)
    drive: Drive | None  # what the path above it did
    path: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    at: list[int] = field(default_factory=list)
    fork_s: list[float] = field(default_factory=list)


@dataclass
class Tree:
    """One branching episode of `req`: the run's settings and what it has gathered."""

    req: EpisodeRequest
    episode: EpisodeSettings
    branching: BranchingConfig
    start_version: int
    t0: float
    started_at: float
    sandbox_s: float
    leaves: list[Rollout] = field(default_factory=list)
    failures: list[BranchFailure] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def harness(self, ep: Episode):
        from tmax.agents.harnesses import make_harness

        return make_harness(self.episode.harness_for(self.req.group_id), ep.workdir)

    def seed(self, path: list[int]) -> int:
        """A branch's sampling seed: its own, so siblings on one context do not sample alike."""
        return random.Random(f"{self.req.seed}/{path}").randrange(2**31)

    def fail(self, b: Branch, kind: str, error: str) -> None:
        with self.lock:
            self.failures.append(BranchFailure(kind, error, list(b.path)))


def run_tree(req: EpisodeRequest, sampler: TokenSampler, tokenizer: Any, episode: EpisodeSettings,
             branching: BranchingConfig, *, image: TaskImage | None = None, pool: SandboxPool | None = None,
             start_version: int = 0) -> GeneratedEpisode:
    """The episode of `req`, forked at `branching.at_turns` (module docstring): its leaves,
    sorted by path, and the branches infrastructure ended. InfraError when it fails before its
    first fork or no leaf is left."""
    t0, started_at = time.monotonic(), time.time()
    ep = open_episode(req, episode.env, image, pool)
    tree = Tree(req, episode, branching, start_version, t0, started_at, time.monotonic() - t0)
    root = Branch(ep, episode.token_policy(sampler, tokenizer, req.seed), None, None)
    _grow(tree, root, root_level=True)
    if not tree.leaves:
        first = tree.failures[0]
        raise InfraError(first.kind, f"every branch failed; the first: {first.error}")
    leaves = sorted(tree.leaves, key=lambda r: r.branch_path)
    return GeneratedEpisode(rollout=leaves[0], more_leaves=leaves[1:], branch_failures=tree.failures)


def _grow(tree: Tree, b: Branch, root_level: bool = False, forks: bool = True) -> None:
    """Drive `b` to its next branch point and fork it there (its children grown side by side),
    or to its end (a leaf). A failure is the branch's (`Tree.fail`), or, at the root before
    any fork, the episode's (raised). When no fork could be made (each a labelled failure),
    `b` goes on unforked (`forks` False) to its end: a sandbox that cannot fork costs the
    tree its branches, not the episode."""
    depth = len(b.path)
    turn = tree.branching.at_turns[depth] if forks and depth < len(tree.branching.at_turns) else None
    try:
        result, agent = _drive(tree, b, turn)
        drive = Drive.of(result, b.policy) if b.drive is None else b.drive.then(result, b.policy.trace,
                                                                               list(b.policy.segments))
        if result.status == AgentStatus.STOPPED and turn is not None:
            children = _fork(tree, b, agent, drive)
            if not children:
                b.agent, b.drive = agent, drive
                return _grow(tree, b, root_level, forks=False)
            b.ep.close()
            with ThreadPoolExecutor(max_workers=len(children), thread_name_prefix="tmax-branch") as ex:
                list(ex.map(lambda c: _grow(tree, c), children))
            return
        score = scored(b.ep, result, tree.episode, None)
        leaf = episode_rollout(tree.req, b.ep, drive, score, agent.harness.name, tree.t0, tree.started_at,
                               tree.sandbox_s, tree.start_version, branch_path=b.path, branch_turns=b.turns,
                               branch_at=b.at, fork_s=b.fork_s)
        with tree.lock:
            tree.leaves.append(leaf)
    except InfraError as e:
        if root_level:
            raise
        tree.fail(b, e.kind, str(e))
    finally:
        b.ep.close()


def _drive(tree: Tree, b: Branch, turn: int | None) -> tuple[EpisodeResult, Agent]:
    """Run `b`'s agent until model turn `turn` is done (None: to the end): from the task at the
    root, else from the conversation it was forked from, with the steps left."""
    stop_at = StopAfterTurn(turn)
    settings = tree.episode.agent
    if b.agent is not None:
        settings = settings.model_copy(update={"max_steps": settings.max_steps - b.agent.steps})
    with EpisodeDriver(b.policy, b.ep.sandbox, tree.harness(b.ep), settings, hooks=stop_at) as driver:
        stop_at.stop = driver.stop
        if b.agent is None:
            return driver.run(b.ep.task.instruction), driver.agent
        driver.agent.continue_from(b.agent)
        return driver.resume(), driver.agent


def _fork(tree: Tree, b: Branch, agent: Agent, drive: Drive) -> list[Branch]:
    """`branches` children of `b` at the turn it stopped after; a fork that fails is a failed branch."""
    children = []
    for j in range(tree.branching.branches):
        path = [*b.path, j]
        t = time.monotonic()
        try:
            child_ep, _record = b.ep.fork()
        except Exception as e:  # the sandbox layer's error, or the pool's: this branch only
            tree.fail(Branch(b.ep, None, None, None, path), "fork", f"fork failed: {e}")
            continue
        children.append(Branch(child_ep, b.policy.fork(tree.seed(path)), agent, drive, path,
                               [*b.turns, agent.steps], [*b.at, len(b.policy.trace.ids)],
                               [*b.fork_s, round(time.monotonic() - t, 4)]))
    return children
