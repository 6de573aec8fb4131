"""The nine structured axes of a synthesized task, as data, and the seeded sampler.

An axis draw is an independent product conditional on the domain: skill type, primitive
skills, scenario and anchor depend on the domain; everything else is drawn on its own.
The corpus kind (`legacy | sft_v2 | rl_v2`) sets how strongly the "new" buckets of the
task-complexity, verifier-kind and fixture-kind axes are up-weighted: with multiplier M
the new bucket gets weight M against the legacy bucket (P(new) = M / (M + 1)), uniform
inside each bucket; M = inf means always new.

The value lists here are a compact version of the original's (9 domains, every domain
with its skill types, personas and anchors); the bucket lists that the balance score
divides by are the fixed orders below (`BUCKETS`).
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CorpusKind = Literal["legacy", "sft_v2", "rl_v2"]
CORPUS_KINDS: tuple[str, ...] = ("legacy", "sft_v2", "rl_v2")
ANCHOR_PROBABILITY = 0.35

DOMAINS: dict[str, dict[str, list[str]]] = {
    "security": {
        "skill_types": ["Systems", "Data Processing", "Web Security", "Algorithmic", "Testing"],
        "skills": ["Cryptographic hashing and checksum verification", "Log forensics and anomaly detection",
                   "Permission and ownership auditing", "Certificate parsing and validation",
                   "Input sanitisation against injection", "Password policy enforcement",
                   "Network capture analysis", "Secret scanning in source trees"],
        "scenarios": ["red-team operator crafting an evasion payload", "SOC analyst triaging an alert",
                      "security engineer hardening a web service", "auditor reviewing file permissions"],
        "anchors": ["a JWT implementation that accepts tokens with algorithm=none",
                    "an HTML sanitiser that lets <script> through inside SVG",
                    "a login form that compares password hashes with a timing leak"],
    },
    "software_engineering": {
        "skill_types": ["Systems", "Algorithmic", "Testing", "Mathematical", "Multi-Language", "Build Systems"],
        "skills": ["Graph traversal and dependency resolution", "Refactoring for testability",
                   "Makefile and build graph authoring", "Semantic version constraint solving",
                   "Writing unit tests for edge cases", "Parsing structured configuration",
                   "Implementing a small interpreter", "Cross-language FFI bindings"],
        "scenarios": ["backend engineer fixing a flaky build", "library maintainer cutting a release",
                      "developer porting a tool to a new language", "data engineer building ETL pipelines"],
        "anchors": ["a semver resolver that picks pre-releases over stable versions",
                    "a Makefile whose parallel build races on a generated header",
                    "a JSON parser that mis-handles surrogate pairs"],
    },
    "file_operations": {
        "skill_types": ["Systems", "Data Processing", "Archiving", "Text Processing"],
        "skills": ["Recursive directory traversal with filters", "Archive creation and extraction",
                   "File deduplication by content hash", "Bulk renaming with patterns",
                   "Symbolic link resolution", "Encoding detection and conversion",
                   "Disk usage accounting", "Atomic file replacement"],
        "scenarios": ["sysadmin cleaning up a shared drive", "photographer organising a camera dump",
                      "archivist packaging records for long-term storage"],
        "anchors": ["a backup script that follows symlinks out of the backup root",
                    "a rename tool that silently overwrites colliding names"],
    },
    "data_querying": {
        "skill_types": ["Data Processing", "Algorithmic", "Databases", "Text Processing"],
        "skills": ["SQL joins and aggregation", "Window functions over time series",
                   "JSON path querying", "Index selection for slow queries",
                   "CSV filtering with awk", "SPARQL over a small graph", "Regex extraction from logs",
                   "Query result validation"],
        "scenarios": ["analyst answering an ad-hoc business question", "DBA investigating a slow report",
                      "data engineer building ETL pipelines"],
        "anchors": ["a reporting query that double counts rows after a LEFT JOIN",
                    "a log query that drops events at midnight UTC boundaries"],
    },
    "data_science": {
        "skill_types": ["Data Processing", "Mathematical", "Machine Learning", "Visualization"],
        "skills": ["Feature scaling and encoding", "Train/test split without leakage",
                   "Model evaluation metrics", "Outlier detection", "Time series resampling",
                   "Hyperparameter search", "Reproducible random seeding", "Summary statistics reporting"],
        "scenarios": ["ML engineer reproducing a paper baseline", "analyst cleaning survey data",
                      "researcher preparing a dataset card"],
        "anchors": ["a preprocessing step that fits the scaler on the test split",
                    "a metric script that averages F1 over classes with no support"],
    },
    "debugging": {
        "skill_types": ["Systems", "Algorithmic", "Testing", "Forensics", "Multi-Language"],
        "skills": ["Git bisection for regression finding", "Reading core dumps and stack traces",
                   "Reproducing a flaky failure", "Off-by-one analysis", "Memory leak hunting",
                   "Tracing system calls", "Minimising a failing input", "Reading compiler diagnostics"],
        "scenarios": ["on-call engineer responding to a 3am page", "maintainer triaging a bug report",
                      "student stuck on a segfault"],
        "anchors": ["a ring buffer that overwrites the oldest entry one slot too early",
                    "a date parser that is off by one hour across DST"],
    },
    "scientific_computing": {
        "skill_types": ["Mathematical", "Algorithmic", "Systems", "Data Processing"],
        "skills": ["Numerical integration", "Linear algebra with sparse matrices",
                   "Floating point error analysis", "Unit conversion and dimensional checks",
                   "Monte Carlo estimation", "Parsing instrument output formats",
                   "Parallelising a loop", "Fitting a curve to measurements"],
        "scenarios": ["physicist post-processing detector data", "bioinformatician assembling reads",
                      "climate scientist regridding model output"],
        "anchors": ["an ODE integrator whose step size control diverges on stiff input",
                    "a FASTA parser that drops the last record without a newline"],
    },
    "data_processing": {
        "skill_types": ["Data Processing", "Text Processing", "Systems", "Algorithmic"],
        "skills": ["Streaming large files line by line", "Schema validation of records",
                   "Deduplicating records by key", "Joining files on a key", "Date and time normalisation",
                   "Character encoding repair", "Aggregating by group", "Writing reproducible pipelines"],
        "scenarios": ["data engineer building ETL pipelines", "operations analyst merging exports",
                      "researcher cleaning scraped text"],
        "anchors": ["a CSV merger that loses rows with embedded newlines",
                    "an ETL job that parses dates in the server's local time zone"],
    },
    "system_administration": {
        "skill_types": ["Systems", "Networking", "Services", "Automation", "Testing"],
        "skills": ["Service configuration and restart", "Cron scheduling", "Log rotation",
                   "User and group management", "Firewall rule review", "Reverse proxy configuration",
                   "Package pinning", "Disk quota and cleanup automation"],
        "scenarios": ["admin fixing an nginx config that returns 502 bad gateway",
                      "sysadmin automating nightly backups", "SRE reducing alert noise"],
        "anchors": ["a logrotate config that truncates logs still held open by the daemon",
                    "a cron job that runs twice across the DST change"],
    },
}

LANGUAGES: dict[str, float] = {"Python": 0.35, "C": 0.15, "Bash": 0.15, "C++": 0.10, "Rust": 0.07, "Go": 0.07,
                               "multi-language": 0.06, "any (model's choice)": 0.05}

TASK_COMPLEXITY: dict[str, str] = {
    "short": "short task (a few shell commands to inspect, act and check)",
    "moderate": "moderate task (several commands across setup, implementation, and verification)",
    "complex": "complex task (many commands spanning dependency installation, code writing, configuration, "
               "building, and testing)",
    "intricate": "intricate task (multi-stage workflow with interacting parts; expect 30-60 commands)",
}
COMMAND_COMPLEXITY: dict[str, str] = {
    "bash-only": "bash-only (coreutils, grep, sed, awk, find)",
    "bash-and-code": "bash and code (scripts in Python, Perl, Ruby or the primary language)",
    "bash-code-services": "bash, code, and system services (package installation, service configuration, "
                          "networking, and containers)",
}
VERIFIER_KINDS = ("exact_text", "metric_threshold", "adversarial_corpus", "fuzz_equivalence", "multi_protocol")
FIXTURE_KINDS = ("text_only", "image", "audio", "video", "stripped_binary", "vendored_package",
                 "multi_service_compose")

# Multiplier of the new bucket per corpus kind and axis; 0 = legacy bucket only.
UPWEIGHT: dict[str, dict[str, float]] = {
    "legacy": {"task_complexity": 0.0, "verifier_kind": 0.0, "fixture_kind": 0.0},
    "sft_v2": {"task_complexity": 2.0, "verifier_kind": 2.0, "fixture_kind": 2.0},
    "rl_v2": {"task_complexity": 3.0, "verifier_kind": math.inf, "fixture_kind": math.inf},
}
# (legacy bucket, new bucket) per up-weighted axis.
_BUCKETS_OF: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "task_complexity": (("short", "moderate", "complex"), ("intricate",)),
    "verifier_kind": (VERIFIER_KINDS[:1], VERIFIER_KINDS[1:]),
    "fixture_kind": (FIXTURE_KINDS[:1], FIXTURE_KINDS[1:]),
}


def _distinct(values) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


# The fixed bucket order of every axis the balance score is computed for (N = its length).
BUCKETS: dict[str, tuple[str, ...]] = {
    "domain": tuple(DOMAINS),
    "skill_type": _distinct(s for d in DOMAINS.values() for s in d["skill_types"]),
    "language": tuple(LANGUAGES),
    "task_complexity": tuple(TASK_COMPLEXITY),
    "command_complexity": tuple(COMMAND_COMPLEXITY),
    "verifier_kind": VERIFIER_KINDS,
    "fixture_kind": FIXTURE_KINDS,
}


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


def _upweighted(rng: random.Random, axis: str, multiplier: float) -> str:
    legacy, new = _BUCKETS_OF[axis]
    if multiplier == 0:
        return rng.choice(legacy)
    if math.isinf(multiplier):
        return rng.choice(new)
    weights = [1.0 / len(legacy)] * len(legacy) + [multiplier / len(new)] * len(new)
    return rng.choices(legacy + new, weights=weights)[0]


def sample_axes(rng: random.Random, corpus_kind: str = "legacy") -> TaskAxes:
    """One independent draw (conditional on the domain) with the corpus kind's weights."""
    if corpus_kind not in UPWEIGHT:
        raise ValueError(f"unknown corpus kind {corpus_kind!r}: choose one of {', '.join(CORPUS_KINDS)}")
    m = UPWEIGHT[corpus_kind]
    domain = rng.choice(list(DOMAINS))
    d = DOMAINS[domain]
    axes = TaskAxes(
        domain=domain,
        skill_type=rng.choice(d["skill_types"]),
        primitive_skills=rng.sample(d["skills"], rng.randint(3, 5)),
        scenario=rng.choice(d["scenarios"]),
        language=rng.choices(list(LANGUAGES), weights=list(LANGUAGES.values()))[0],
        task_complexity=_upweighted(rng, "task_complexity", m["task_complexity"]),
        command_complexity=rng.choice(list(COMMAND_COMPLEXITY)),
        verifier_kind=_upweighted(rng, "verifier_kind", m["verifier_kind"]),
        fixture_kind=_upweighted(rng, "fixture_kind", m["fixture_kind"]),
        anchor=rng.choice(d["anchors"]) if rng.random() < ANCHOR_PROBABILITY else None,
        corpus_kind=corpus_kind,
    )
    new_kind = (axes.task_complexity == "intricate" or axes.verifier_kind != VERIFIER_KINDS[0]
                or axes.fixture_kind != FIXTURE_KINDS[0])
    axes.base_image = "intricate" if new_kind else domain
    return axes


def normalize_complexity(value: str, table: dict[str, str]) -> str:
    """Map a long description ("short task (...)") or a key to the key; unknown stays."""
    v = value.strip()
    if v in table:
        return v
    for key, text in table.items():
        if v.lower().startswith(text.split(" (")[0].lower()):
            return key
    return v
