"""The nine structured axes of a synthesized task, as data, and the seeded sampler.

The values live in `tasks/data/axes.toml` (or a file of the same shape given with
`--axes`, to grow a corpus for other domains), validated by `AxesConfig`. An axis draw is
an independent product conditional on the domain: skill type, primitive skills, scenario
and anchor depend on the domain; everything else is drawn on its own. `generate` does not draw tasks one by one
but plans the corpus (`stratified_plan`): quotas per stratum (domain x skill type) and per
value of every other axis, so even 100 tasks are as balanced as integers allow. The corpus kind
(`legacy | sft_v2 | rl_v2`) sets how strongly the "new" buckets of the task-complexity,
verifier-kind and fixture-kind axes are up-weighted: with multiplier M the new bucket
gets weight M against the legacy bucket (P(new) = M / (M + 1)), uniform inside each
bucket; M = inf means always new.

The bundled lists have the original's cardinalities: 9 domains; 4-7 skill types per domain
(52 pairs, 29 distinct names); 20-40 primitive skills per domain (283); 5-18 personas per
domain (85 slots, 73 distinct: some are shared between domains); 3-7 anchors per domain.
The balance score divides by the length of each axis's fixed list (`AxesConfig.buckets`;
skill_type N = 29, primitive skills 283, personas 73), so it is comparable to the paper's.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CORPUS_KINDS: tuple[str, ...] = ("legacy", "sft_v2", "rl_v2")
DEFAULT_AXES = Path(__file__).resolve().parents[1] / "data" / "axes.toml"

# Multiplier of the new bucket per corpus kind and axis; 0 = legacy bucket only.
UPWEIGHT: dict[str, dict[str, float]] = {
    "legacy": {"task_complexity": 0.0, "verifier_kind": 0.0, "fixture_kind": 0.0},
    "sft_v2": {"task_complexity": 2.0, "verifier_kind": 2.0, "fixture_kind": 2.0},
    "rl_v2": {"task_complexity": 3.0, "verifier_kind": math.inf, "fixture_kind": math.inf},
}


class AxesError(ValueError):
    pass


class DomainAxes(BaseModel):
    """One domain's table of the axes file (`[domains.NAME]`): what a task of it draws from."""

    model_config = ConfigDict(extra="forbid")

    skill_types: Annotated[list[str], Field(min_length=1, description="The kinds of work a task of the domain is.")]
    skills: Annotated[list[str], Field(min_length=5, description="Primitive skills; up to 5 are drawn per task, "
                                                                 "without replacement.")]
    scenarios: Annotated[list[str], Field(min_length=1, description="Situations a task is set in.")]
    anchors: Annotated[list[str], Field(default_factory=list, description="Concrete tools or artefacts a task may "
                                                                          "be anchored on.")]


class AxesConfig(BaseModel):
    """The axes file (tasks/data/axes.toml, or `--axes`): every value each axis of a generated
    task can take, and how the newer buckets are weighted."""

    model_config = ConfigDict(extra="forbid")

    anchor_probability: Annotated[float, Field(ge=0, le=1, description="How often a task is anchored on one of its "
                                                                       "domain's anchors.")] = 0.35
    verifier_kinds: Annotated[list[str], Field(min_length=2, description="How a task is checked; the first is the "
                                                                         "legacy bucket, the rest the new one.")]
    fixture_kinds: Annotated[list[str], Field(min_length=2, description="What a task's input files are; the first is "
                                                                        "the legacy bucket, the rest the new one.")]
    new_task_complexity: Annotated[list[str], Field(min_length=1, description="The task_complexity keys of the new "
                                                                              "bucket (the others are legacy).")]
    languages: Annotated[dict[str, float], Field(min_length=1, description="Language -> its sampling weight.")]
    task_complexity: Annotated[dict[str, str], Field(description="Task complexity -> what it means, as the "
                                                                 "generating model is told.")]
    command_complexity: Annotated[dict[str, str], Field(min_length=1, description="Command complexity -> what it "
                                                                                  "means, as the model is told.")]
    domains: Annotated[dict[str, DomainAxes], Field(min_length=1, description="Domain -> what its tasks draw from.")]

    @model_validator(mode="after")
    def _buckets_exist(self) -> "AxesConfig":
        legacy = [k for k in self.task_complexity if k not in self.new_task_complexity]
        missing = [k for k in self.new_task_complexity if k not in self.task_complexity]
        if missing or not legacy:
            raise ValueError("new_task_complexity must name task_complexity keys and leave at least one "
                             f"legacy key (unknown: {missing})")
        if any(w < 0 for w in self.languages.values()) or sum(self.languages.values()) <= 0:
            raise ValueError("languages: weights must be >= 0 with a positive sum")
        return self

    def split(self, axis: str) -> tuple[list[str], list[str]]:
        """(legacy bucket, new bucket) of an up-weighted axis."""
        if axis == "task_complexity":
            new = list(self.new_task_complexity)
            return [k for k in self.task_complexity if k not in new], new
        values = self.verifier_kinds if axis == "verifier_kind" else self.fixture_kinds
        return values[:1], values[1:]

    def buckets(self) -> dict[str, tuple[str, ...]]:
        """The fixed bucket order of every axis the balance score is computed for."""
        def distinct(attr: str) -> tuple[str, ...]:
            return tuple(dict.fromkeys(v for d in self.domains.values() for v in getattr(d, attr)))

        return {"domain": tuple(self.domains), "skill_type": distinct("skill_types"),
                "primitive_skills": distinct("skills"), "scenario": distinct("scenarios"),
                "language": tuple(self.languages), "task_complexity": tuple(self.task_complexity),
                "command_complexity": tuple(self.command_complexity),
                "verifier_kind": tuple(self.verifier_kinds), "fixture_kind": tuple(self.fixture_kinds)}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]


def load_axes(path: str | Path | None = None) -> AxesConfig:
    """The axes file (default: the bundled one); errors name the file and the field."""
    if path is None:
        return _default_axes()
    return _read_axes(Path(path).expanduser())


@lru_cache(maxsize=1)
def _default_axes() -> AxesConfig:
    return _read_axes(DEFAULT_AXES)


def _read_axes(path: Path) -> AxesConfig:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise AxesError(f"{path}: cannot read the axes file: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise AxesError(f"{path}: invalid TOML: {e}") from None
    try:
        return AxesConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        raise AxesError(f"{path}: {where}: {err['msg'].removeprefix('Value error, ')}") from None


class TaskAxes(BaseModel):
    """One draw of the axes; stored under `[metadata]` of the task's task.toml."""

    model_config = ConfigDict(extra="allow")

    domain: Annotated[str, Field(description="One of the axes file's domains.")]
    skill_type: Annotated[str, Field(description="One of the domain's skill types.")]
    primitive_skills: Annotated[list[str], Field(default_factory=list, description="The domain's skills it needs.")]
    scenario: Annotated[str, Field(description="One of the domain's scenarios.")] = ""
    language: Annotated[str, Field(description="The language of its solution.")] = "Python"
    task_complexity: Annotated[str, Field(description="A task_complexity key of the axes file.")] = "moderate"
    command_complexity: Annotated[str, Field(description="A command_complexity key of the axes file.")] = "bash-only"
    verifier_kind: Annotated[str, Field(description="How it is checked (the axes file's verifier_kinds).")] = "exact_text"
    fixture_kind: Annotated[str, Field(description="What its input files are (fixture_kinds).")] = "text_only"
    anchor: Annotated[str | None, Field(description="The anchor it is built around; None: none.")] = None
    corpus_kind: Annotated[str, Field(description="The corpus kind it was drawn for (legacy, sft_v2, rl_v2).")] = "legacy"
    base_image: Annotated[str, Field(description="The base its environment starts from.")] = "default"

    def metadata(self) -> dict:
        """The `[metadata]` table (TOML has no null: an absent anchor is left out)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def axis_weights(axes: AxesConfig, axis: str, corpus_kind: str) -> dict[str, float]:
    """Sampling weights of an axis that does not depend on the domain, for a corpus kind."""
    if axis == "language":
        return dict(axes.languages)
    if axis == "command_complexity":
        return dict.fromkeys(axes.command_complexity, 1.0)
    multiplier = UPWEIGHT[corpus_kind][axis]
    legacy, new = axes.split(axis)
    if multiplier == 0 or not new:
        return dict.fromkeys(legacy, 1.0 / len(legacy))
    if math.isinf(multiplier):
        return dict.fromkeys(new, 1.0 / len(new))
    return {**dict.fromkeys(legacy, 1.0 / len(legacy)), **dict.fromkeys(new, multiplier / len(new))}


FREE_AXES = ("language", "task_complexity", "command_complexity", "verifier_kind", "fixture_kind")


def _check_kind(corpus_kind: str) -> None:
    if corpus_kind not in UPWEIGHT:
        raise ValueError(f"unknown corpus kind {corpus_kind!r}: choose one of {', '.join(CORPUS_KINDS)}")


def axes_in_stratum(rng: random.Random, axes: AxesConfig, corpus_kind: str, domain: str, skill_type: str,
                    free: dict[str, str]) -> TaskAxes:
    """A draw with its stratum and its domain-free axes given: primitive skills, scenario
    and anchor come from the domain's pools."""
    d = axes.domains[domain]
    draw = TaskAxes(domain=domain, skill_type=skill_type, primitive_skills=rng.sample(d.skills, rng.randint(3, 5)),
                    scenario=rng.choice(d.scenarios),
                    anchor=rng.choice(d.anchors) if d.anchors and rng.random() < axes.anchor_probability else None,
                    corpus_kind=corpus_kind, **free)
    is_new = (draw.task_complexity in axes.new_task_complexity or draw.verifier_kind != axes.verifier_kinds[0]
              or draw.fixture_kind != axes.fixture_kinds[0])
    draw.base_image = "intricate" if is_new else domain
    return draw


def sample_axes(rng: random.Random, corpus_kind: str = "legacy", axes: AxesConfig | None = None) -> TaskAxes:
    """One independent draw (conditional on the domain) with the corpus kind's weights."""
    _check_kind(corpus_kind)
    axes = axes or load_axes()
    domain = rng.choice(list(axes.domains))
    skill_type = rng.choice(axes.domains[domain].skill_types)
    free = {}
    for axis in FREE_AXES:
        w = axis_weights(axes, axis, corpus_kind)
        free[axis] = rng.choices(list(w), weights=list(w.values()))[0]
    return axes_in_stratum(rng, axes, corpus_kind, domain, skill_type, free)


def largest_remainder(n: int, weights: dict[str, float], rng: random.Random) -> dict[str, int]:
    """Integer quotas summing to n, proportional to the weights (Hamilton's method); the
    leftover units go to the largest remainders, ties in a seeded random order."""
    total = sum(weights.values())
    exact = {k: n * w / total for k, w in weights.items()}
    quotas = {k: math.floor(v) for k, v in exact.items()}
    keys = list(exact)
    rng.shuffle(keys)
    for k in sorted(keys, key=lambda k: quotas[k] - exact[k])[:n - sum(quotas.values())]:
        quotas[k] += 1
    return quotas


def _spread(quotas: dict[str, int], rng: random.Random) -> list[str]:
    values = [v for v, c in quotas.items() for _ in range(c)]
    rng.shuffle(values)
    return values


def stratified_plan(n: int, seed: int, corpus_kind: str = "legacy", axes: AxesConfig | None = None) -> list[TaskAxes]:
    """n draws whose strata (domain x skill type) and other domain-free axes follow their
    weights as closely as integers allow: largest-remainder quotas over the domains, then
    over the skill types of each domain, then over each other axis, shuffled together with
    a seeded RNG. Slot i's own RNG draws the rest (skills, scenario, anchor)."""
    _check_kind(corpus_kind)
    axes = axes or load_axes()
    rng = random.Random(f"tmax-data-plan:{seed}:{corpus_kind}")
    strata: list[tuple[str, str]] = []
    for domain, q in largest_remainder(n, dict.fromkeys(axes.domains, 1.0), rng).items():
        skills = largest_remainder(q, dict.fromkeys(axes.domains[domain].skill_types, 1.0), rng)
        strata += [(domain, s) for s, c in skills.items() for _ in range(c)]
    rng.shuffle(strata)
    free = {axis: _spread(largest_remainder(n, axis_weights(axes, axis, corpus_kind), rng), rng) for axis in FREE_AXES}
    return [axes_in_stratum(random.Random(f"tmax-data:{seed}:{i}"), axes, corpus_kind, d, s,
                            {axis: free[axis][i] for axis in FREE_AXES})
            for i, (d, s) in enumerate(strata)]


def redraw(slot: TaskAxes, seed: int, index: int, attempt: int, axes: AxesConfig) -> TaskAxes:
    """A fresh task for a slot whose earlier attempt was rejected: the same stratum and
    domain-free axes, new skills, scenario and anchor."""
    if attempt == 0:
        return slot.model_copy(deep=True)
    free = {axis: getattr(slot, axis) for axis in FREE_AXES}
    return axes_in_stratum(random.Random(f"tmax-data:{seed}:{index}:{attempt}"), axes, slot.corpus_kind,
                           slot.domain, slot.skill_type, free)


def normalize_complexity(value: str, table: dict[str, str]) -> str:
    """Map a long description ("short task (...)") or a key to the key; unknown stays."""
    v = value.strip()
    if v in table:
        return v
    for key, text in table.items():
        if v.lower().startswith(text.split(" (")[0].lower()):
            return key
    return v
