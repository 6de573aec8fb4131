"""The nine structured axes of a synthesized task, as data, and the seeded sampler.

The values live in `tasks/data/axes.toml` (or a file of the same shape given with
`--axes`, to grow a corpus for other domains), validated by `AxesConfig`. An axis draw is
an independent product conditional on the domain: skill type, primitive skills, scenario
and anchor depend on the domain; everything else is drawn on its own. The corpus kind
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
    model_config = ConfigDict(extra="forbid")

    skill_types: list[str] = Field(min_length=1)
    skills: list[str] = Field(min_length=5)  # up to 5 are drawn without replacement
    scenarios: list[str] = Field(min_length=1)
    anchors: list[str] = Field(default_factory=list)


class AxesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor_probability: float = Field(0.35, ge=0, le=1)
    verifier_kinds: list[str] = Field(min_length=2)  # first = legacy bucket
    fixture_kinds: list[str] = Field(min_length=2)  # first = legacy bucket
    new_task_complexity: list[str] = Field(min_length=1)
    languages: dict[str, float] = Field(min_length=1)
    task_complexity: dict[str, str]
    command_complexity: dict[str, str] = Field(min_length=1)
    domains: dict[str, DomainAxes] = Field(min_length=1)

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

    domain: str
    skill_type: str
    primitive_skills: list[str] = Field(default_factory=list)
    scenario: str = ""
    language: str = "Python"
    task_complexity: str = "moderate"
    command_complexity: str = "bash-only"
    verifier_kind: str = "exact_text"
    fixture_kind: str = "text_only"
    anchor: str | None = None
    corpus_kind: str = "legacy"
    base_image: str = "default"

    def metadata(self) -> dict:
        """The `[metadata]` table (TOML has no null: an absent anchor is left out)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def _upweighted(rng: random.Random, axes: AxesConfig, axis: str, multiplier: float) -> str:
    legacy, new = axes.split(axis)
    if multiplier == 0 or not new:
        return rng.choice(legacy)
    if math.isinf(multiplier):
        return rng.choice(new)
    weights = [1.0 / len(legacy)] * len(legacy) + [multiplier / len(new)] * len(new)
    return rng.choices(legacy + new, weights=weights)[0]


def sample_axes(rng: random.Random, corpus_kind: str = "legacy", axes: AxesConfig | None = None) -> TaskAxes:
    """One independent draw (conditional on the domain) with the corpus kind's weights."""
    if corpus_kind not in UPWEIGHT:
        raise ValueError(f"unknown corpus kind {corpus_kind!r}: choose one of {', '.join(CORPUS_KINDS)}")
    axes = axes or load_axes()
    m = UPWEIGHT[corpus_kind]
    domain = rng.choice(list(axes.domains))
    d = axes.domains[domain]
    draw = TaskAxes(
        domain=domain,
        skill_type=rng.choice(d.skill_types),
        primitive_skills=rng.sample(d.skills, rng.randint(3, 5)),
        scenario=rng.choice(d.scenarios),
        language=rng.choices(list(axes.languages), weights=list(axes.languages.values()))[0],
        task_complexity=_upweighted(rng, axes, "task_complexity", m["task_complexity"]),
        command_complexity=rng.choice(list(axes.command_complexity)),
        verifier_kind=_upweighted(rng, axes, "verifier_kind", m["verifier_kind"]),
        fixture_kind=_upweighted(rng, axes, "fixture_kind", m["fixture_kind"]),
        anchor=rng.choice(d.anchors) if d.anchors and rng.random() < axes.anchor_probability else None,
        corpus_kind=corpus_kind,
    )
    is_new = (draw.task_complexity in axes.new_task_complexity or draw.verifier_kind != axes.verifier_kinds[0]
              or draw.fixture_kind != axes.fixture_kinds[0])
    draw.base_image = "intricate" if is_new else domain
    return draw


def normalize_complexity(value: str, table: dict[str, str]) -> str:
    """Map a long description ("short task (...)") or a key to the key; unknown stays."""
    v = value.strip()
    if v in table:
        return v
    for key, text in table.items():
        if v.lower().startswith(text.split(" (")[0].lower()):
            return key
    return v
