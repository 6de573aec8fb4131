"""`tmax data import --format native`: the generator's own layout.

    task_<idx>_<uuid8>/task.json              axes (domain, skill_type, primitive_skills, scenario,
                                              language, task_complexity, command_complexity,
                                              verifier_kind, fixture_kind, corpus_kind, base_image,
                                              anchor), `description` (the instruction), `truth`
    task_<idx>_<uuid8>/container.def          Apptainer def: `From`, %environment, %post, %files
    task_<idx>_<uuid8>/setup.sh               the %post delta on the domain's shared base image
    task_<idx>_<uuid8>/test_initial_state.py  checks the starting state
    task_<idx>_<uuid8>/test_final_state.py    the verifier
    task_<idx>_<uuid8>/fixtures/              files the %files section copies into the image
    task_<idx>_<uuid8>/task_summary.txt       kept as [metadata] task_summary
    task_<idx>_<uuid8>/solutions/*summary.json  pass@k summaries (`summary.json`, later
                                              `<MODEL_TAG>[_vanillux][_thinking]_summary.json`:
                                              num_runs, num_success, pass_at_k, results...)

The Dockerfile: the def's `From`, its %environment as ENV, the shared base layer
(`tasks/data/native_bases.toml`: the intricate layer for base_image = "intricate"; the
domain's base for a task that has only a setup.sh delta), COPY of every %files entry to
its destination (fixtures go to /app/fixtures/ when %files names none), then the %post
(or setup.sh) as a script. The agent runs as `user` in /home/user, as in the original.
Solution summaries become [metadata] solutions.<tag> = {num_runs, num_success, pass_at_k}
and `<out>/.tmax-solve/<tag>/<task>.json`, so `tmax data report` shows their success rates.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tomllib
from functools import lru_cache
from pathlib import Path, PurePosixPath

from tmax.common.records import SolveSummary, write_record
from tmax.tasks.corpus.axes import TaskAxes
from tmax.tasks.corpus.corpus import normalized_axes
from tmax.tasks.corpus.package import AGENT_USER, HOME, TaskParts, write_task
from tmax.tasks.corpus.balance_report import SOLVE_DIR

BASES_FILE = Path(__file__).resolve().parents[1] / "data" / "native_bases.toml"
FIXTURES_DEST = "/app/fixtures/"


class NativeError(ValueError):
    """A source task that cannot be converted; the message names the file."""


@lru_cache(maxsize=1)
def _bases() -> dict:
    return tomllib.loads(BASES_FILE.read_text())


def def_sections(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(header keys, %sections) of an Apptainer definition file."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = re.match(r"^%(\w+)\s*$", line.strip())
        if m:
            current = m.group(1).lower()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
        elif ":" in line and not line.lstrip().startswith("#"):
            k, v = line.split(":", 1)
            header[k.strip().lower()] = v.strip()
    return header, {k: "\n".join(v).strip("\n") for k, v in sections.items()}


def base_layer(apt: list[str], pip: list[str], extra_index: str | None = None) -> list[str]:
    """RUN steps installing a base image's packages."""
    steps = []
    if apt:
        steps.append("RUN apt-get update && apt-get install -y --no-install-recommends "
                      + " ".join(apt) + " && rm -rf /var/lib/apt/lists/*")
    if pip:
        index = f" --extra-index-url {extra_index}" if extra_index else ""
        steps.append(f"RUN pip3 install --no-cache-dir{index} " + " ".join(pip))
    return steps


def _base_steps(base_image: str, domain: str, delta_only: bool) -> list[str]:
    bases = _bases()
    if base_image == "intricate":
        b = bases["intricate"]
        return base_layer(b.get("apt", []), b.get("pip", []), b.get("pip_extra_index"))
    if not delta_only:
        return []  # a full def installs what it needs in its own %post
    dom = bases.get("domains", {}).get(domain, {})
    return base_layer(bases["common"]["apt"] + dom.get("apt", []), bases["common"]["pip"] + dom.get("pip", []))


def _files_source(src: Path, name: str) -> Path | None:
    """Where a %files source of the original build is in the task folder."""
    p = PurePosixPath(name)
    candidates = [] if p.is_absolute() else [src / name]
    parts = p.parts
    if "fixtures" in parts:
        candidates.append(src.joinpath(*parts[parts.index("fixtures"):]))
    candidates.append(src / "fixtures" / p.name)
    return next((c for c in candidates if c.exists() and src.resolve() in c.resolve().parents), None)


def files_entries(src: Path, section: str) -> list[tuple[str, str]]:
    """(build-context path, image destination) of every %files line; NativeError names a
    source the task folder does not have."""
    out = []
    for line in section.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line)
        source = _files_source(src, words[0])
        if source is None:
            raise NativeError(f"{src / 'container.def'}: %files line `{line.strip()}`: {words[0]} is not in the "
                              "task folder (nor under fixtures/)")
        rel = source.relative_to(src).as_posix()
        dest = words[1] if len(words) > 1 else words[0]
        out.append((rel + ("/" if source.is_dir() else ""), dest))
    return out


def dockerfile_from_def(text: str, setup_sh: str | None, has_fixtures: bool, *, base_image: str = "default",
                        domain: str = "", files: list[tuple[str, str]] | None = None) -> tuple[str, dict[str, str]]:
    """(Dockerfile, generated build-context files) of a container.def (+ setup.sh)."""
    header, sections = def_sections(text)
    if not header.get("from"):
        raise NativeError("container.def has no `From:` line")
    # The defs target ubuntu:22.04, whose pip installs into the system; on a Debian base
    # (the offline image map) PEP 668 would refuse the same `pip3 install`.
    lines = [f"FROM {header['from']}", "ENV DEBIAN_FRONTEND=noninteractive", "ENV PIP_BREAK_SYSTEM_PACKAGES=1"]
    for env_line in sections.get("environment", "").splitlines():
        m = re.match(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", env_line)
        if m:
            lines.append(f"ENV {m.group(1)}={m.group(2).strip()}")
    post = sections.get("post") or ""
    lines += _base_steps(base_image, domain, delta_only=not post.strip())
    post = post or (setup_sh or "")
    if files:
        lines += [f"COPY {shlex.quote(rel)} {shlex.quote(dest)}" for rel, dest in files]
    elif has_fixtures:
        lines.append(f"COPY fixtures/ {FIXTURES_DEST}")
    generated: dict[str, str] = {}
    if post.strip():
        generated["post_install.sh"] = "#!/bin/bash\nset -e\n" + post + "\n"
        lines += ["COPY post_install.sh /tmp/post_install.sh", "RUN bash /tmp/post_install.sh && rm /tmp/post_install.sh"]
    if not re.search(r"\buseradd\b", post):
        # A setup.sh delta has the standard preamble (useradd, chmod) stripped: put it back.
        lines.append(f"RUN useradd -m {AGENT_USER} && chmod -R 777 {HOME}")
    lines.append(f"WORKDIR {HOME}")
    return "\n".join(lines) + "\n", generated


def solution_summaries(src: Path) -> dict[str, dict]:
    """{tag: {num_runs, num_success, pass_at_k}} of the non-empty summaries under solutions/."""
    out = {}
    for f in sorted((src / "solutions").glob("*summary.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise NativeError(f"{f}: {e}") from None
        if not isinstance(data, dict) or "num_runs" not in data:
            continue  # `summary.json` starts as {} until a solver writes it
        tag = f.name.removesuffix("summary.json").rstrip("_") or "summary"
        out[tag] = {"num_runs": int(data["num_runs"]), "num_success": int(data.get("num_success", 0)),
                    "pass_at_k": {str(k): float(v) for k, v in (data.get("pass_at_k") or {}).items()}}
    return out


def _read_task_json(src: Path) -> dict:
    meta_path = src / "task.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NativeError(f"{meta_path}: {e}") from None
    for need in ("container.def", "test_final_state.py"):
        if not (src / need).is_file():
            raise NativeError(f"{src / need}: missing")
    if not str(meta.get("description") or "").strip():
        raise NativeError(f"{meta_path}: no description (the agent's instruction)")
    return meta


def convert(src: Path, dest: Path) -> None:
    meta = _read_task_json(src)
    axis_keys = set(TaskAxes.model_fields) | {"source"}
    axes_data = normalized_axes({k: v for k, v in meta.items() if k in axis_keys and v is not None})
    axes_data.setdefault("domain", "unknown")
    axes_data.setdefault("skill_type", "unknown")
    summary = src / "task_summary.txt"
    if summary.is_file():
        axes_data["task_summary"] = summary.read_text(encoding="utf-8", errors="replace").strip()
    solutions = solution_summaries(src)
    if solutions:
        axes_data["solutions"] = solutions
    def_text = (src / "container.def").read_text()
    _, sections = def_sections(def_text)
    entries = files_entries(src, sections.get("files", ""))
    setup = src / "setup.sh"
    fixtures = src / "fixtures"
    dockerfile, generated = dockerfile_from_def(
        def_text, setup.read_text() if setup.is_file() else None, fixtures.is_dir(),
        base_image=str(meta.get("base_image") or ""), domain=str(meta.get("domain") or ""), files=entries)
    initial = src / "test_initial_state.py"
    parts = TaskParts(name=dest.name, axes=TaskAxes(**axes_data), instruction=meta["description"],
                      truth=str(meta.get("truth") or ""),
                      initial_test=initial.read_text() if initial.is_file() else None,
                      final_test=(src / "test_final_state.py").read_text(), dockerfile=dockerfile,
                      env_files=generated)
    write_task(parts, dest)
    for rel, _ in entries:
        target = dest / "environment" / rel.rstrip("/")
        if not target.exists():
            copy = shutil.copytree if (src / rel).is_dir() else shutil.copyfile
            target.parent.mkdir(parents=True, exist_ok=True)
            copy(src / rel.rstrip("/"), target)
    if fixtures.is_dir() and not (dest / "environment" / "fixtures").exists():
        shutil.copytree(fixtures, dest / "environment" / "fixtures", symlinks=True)
    for tag, s in solutions.items():
        write_record(dest.parent / SOLVE_DIR / tag / f"{dest.name}.json", SolveSummary(task=dest.name, **s))
