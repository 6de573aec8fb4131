"""The generator seam: the one interface between the trainer and where its episodes come from.

The trainer (`training.trainer`) asks for episodes and gets scored, token-exact episodes back;
it knows nothing of tasks, sandboxes, pools or verifiers. A `Generator` is one source of
episodes for a run, made before the run starts (its tasks already prepared):

    generator.prompts                 what groups are sampled from (a task dir, a text prompt's id)
    generator.worker(model_dir)       a `WorkerSpec`: the `EpisodeWorker` each rollout worker (a
                                      Ray actor) runs, handed its engine's sampler and slots
    worker.generate(request, version) one `EpisodeRequest` in, one `GeneratedEpisode` out: a
                                      `Rollout` (reward, `TokenTrace`; a branching episode's
                                      leaves, `rollout.branching`), or an infrastructure
                                      failure the trainer re-queues, never scores
    generator.warm_ahead(workers)     told the requests next in line (e.g. to start sandboxes)
    generator.task_counts()           the tasks it runs and dropped, for the run's summary.json

Two implement it: `training.harbor_generator` (Harbor tasks in sandboxes, `training.rollout`)
and `training.text_generator` (text prompts with an answer, one model turn, no sandbox); the
run's `tasks.format` picks one (`training.entry`). import-linter keeps the loop off
`tmax.sandbox`, `tmax.tasks` and the rollout's internals (pyproject.toml, "generator-seam").
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from tmax.agents.policy import TokenTrace
from tmax.common.records import TaskCounts


@dataclass
class EpisodeRequest:
    task_dir: str  # the prompt: a Harbor task dir, or a text prompt's id (`Generator.prompts`)
    group_id: int
    sample_index: int
    seed: int
    attempt: int = 0  # re-queues after infrastructure failures

    @property
    def key(self) -> str:
        return f"{self.group_id}:{self.sample_index}"


@dataclass
class Rollout:
    """Everything the trainer and a later analysis need about one episode. `trace` is the
    token policy's `TokenTrace`, kept as it is: the trainer packs it (training.learner.packing).
    An episode that compacted (`rollout.compaction`) has the segments before it in `segments`:
    each is a sample of its own, with the episode's reward (`traces`)."""

    task_id: str
    group_id: int
    sample_index: int
    seed: int
    trace: TokenTrace
    reward: float
    status: str  # submitted | max_steps | context_overflow | format_errors
    steps: int
    policy_version: int  # weights version of the oldest sampled turn
    truncated: bool = False
    submitted: bool = False
    verifier: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    harness: str = "tmax"
    sandbox: str = ""  # the sandbox kind the episode ran in
    container_id: str | None = None  # podman: the container the episode (and verifier) ran in
    warm_start: bool = False  # the container came started from the worker's warm pool
    sandbox_mode: str = ""  # podman: "overlay", "overlay+files" or "container" (`Episode.sandbox_mode`)
    command_s: list[float] = field(default_factory=list)  # each command's round trip (issue -> output back)
    turn_outcomes: list[str] = field(default_factory=list)  # per model turn (`agents.driver.turn_outcome`)
    started_at: float = 0.0  # when the episode began (epoch seconds)
    segments: list[TokenTrace] = field(default_factory=list)  # closed by compactions, in order
    # A branching episode's leaf (`rollout.branching`): the branch it took at each fork, the
    # model turns done at each fork, and where in `trace.ids` each fork was (its siblings share
    # every token before it). Empty: the episode was not forked.
    branch_path: list[int] = field(default_factory=list)
    branch_turns: list[int] = field(default_factory=list)
    branch_at: list[int] = field(default_factory=list)
    fork_s: list[float] = field(default_factory=list)  # each fork's seconds

    @property
    def traces(self) -> list[TokenTrace]:
        """Every token segment of the episode, the last (`trace`) included."""
        return [*self.segments, self.trace]

    @property
    def num_sampled(self) -> int:
        return sum(t.num_sampled for t in self.traces)

    @property
    def ids(self) -> list[int]:
        """The response tokens (`trace.ids`)."""
        return self.trace.ids

    @property
    def turn_versions(self) -> list[int]:
        """The weights version of each sampled turn (`trace.turn_versions`)."""
        return self.trace.turn_versions

    def to_json(self) -> str:
        """One flat JSON object: the episode's fields and the trace's lists side by side."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("trace", "segments")}
        return json.dumps({**record, **asdict(self.trace), "segments": [asdict(t) for t in self.segments]})

    @classmethod
    def from_json(cls, line: str) -> "Rollout":
        record = json.loads(line)
        trace = TokenTrace(**{f.name: record.pop(f.name) for f in fields(TokenTrace) if f.name in record})
        segments = [TokenTrace(**t) for t in record.pop("segments", [])]
        return cls(trace=trace, segments=segments, **record)


@dataclass
class InfraCounts:
    """Infrastructure errors of a run by kind (`env/infra_errors`, `env/infra_errors/<kind>`)."""

    by_kind: dict[str, int] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)  # kind -> the latest message, for people

    def add(self, kind: str, task_dir: str, message: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.last[kind] = f"{Path(task_dir).name}: {message}"

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def metrics(self) -> dict[str, float]:
        return {"env/infra_errors": float(self.total),
                **{f"env/infra_errors/{k}": float(v) for k, v in sorted(self.by_kind.items())}}


@dataclass
class GeneratedEpisode:
    """What a worker returns for one request: the scored episode, or why it could not run
    (`infra_kind` as `training.rollout.INFRA_KINDS` names it). `ran` is False for a request a
    restarting worker refused: it is re-queued without counting as an attempt."""

    rollout: Rollout | None = None
    infra_error: str = ""
    infra_kind: str = ""
    ran: bool = True
    # A branching episode (`rollout.branching`): its other leaves (`rollout` is the first), and
    # the branches lost to infrastructure (kept out of the loss, counted per kind).
    more_leaves: list[Rollout] = field(default_factory=list)
    branch_failures: list[BranchFailure] = field(default_factory=list)

    @property
    def leaves(self) -> list[Rollout]:
        return [self.rollout, *self.more_leaves] if self.rollout is not None else []


@dataclass
class BranchFailure:
    """A branch of a forked episode that infrastructure ended (its fork, its sandbox, its
    verifier): no leaf, never scored."""

    kind: str  # as `training.rollout.INFRA_KINDS` names it
    error: str
    branch_path: list[int]


class EpisodeWorker(Protocol):
    """The episodes of one rollout worker (a Ray actor), `slots` at a time."""

    def generate(self, req: EpisodeRequest, version: int) -> GeneratedEpisode:
        """Run and score one episode; `version` is the weights version the engine serves."""
        ...

    def prewarm(self, prompt: str) -> bool:
        """Get ready for a coming episode of `prompt` (False: nothing was started)."""
        ...

    def node_id(self) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WorkerSpec:
    """How to make a generator's `EpisodeWorker` as a Ray actor: `cls(sampler=, slots=, **kwargs)`,
    with the sampler of the engine it is given and its episode slots."""

    cls: type
    kwargs: dict[str, Any]


class Ahead(Protocol):
    def fill(self, coming: Iterable[tuple[EpisodeRequest, int]]) -> None:
        """The requests next in line, in dispatch order, each with the worker it will go to."""
        ...


class Generator(Protocol):
    """A run's source of scored, token-exact episodes (see the module docstring)."""

    prompts: list[str]
    # Every sandbox of the run carries them, so a dead worker's can be found and removed
    # (None: the episodes leave nothing behind).
    labels: dict[str, str] | None

    def worker(self, model_dir: str) -> WorkerSpec: ...

    def warm_ahead(self, workers: list[Any]) -> Ahead: ...

    def task_counts(self) -> TaskCounts: ...
