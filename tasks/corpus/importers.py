"""`tmax data import`: the published corpus layouts, converted to Harbor tasks.

harbor         the Harbor export: task directories with the axes in `[metadata]`;
               copied as they are (each must load), `[agent] user` included
open-instruct  the RL training copy: `instruction.md`, `tests/`, optional
               `environment/seeds/` (uploaded to /workspace) and `image.txt` naming a
               prebuilt image; becomes a Dockerfile FROM that image (also set as
               `docker_image`, used when it can be pulled)
native         the generator's own layout: `task.json` (axes, description, truth),
               `test_initial_state.py`, `test_final_state.py`, `container.def` (+ `setup.sh`)
               and `fixtures/`; the def's `From` and `%post` / `%environment` become a
               Dockerfile (the %post runs as a copied script), fixtures go to /app/fixtures;
               the agent runs as `user` in /home/user (`[agent] user`), as in the original
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import tomli_w

from tasks.corpus.axes import TaskAxes
from tasks.corpus.corpus import normalized_axes
from tasks.corpus.package import AGENT_USER, HOME, LITE_RUNNER, TEST_SH, TaskParts, write_executable, write_task
from tasks.model import Task, TaskError

FORMATS = ("harbor", "open-instruct", "native")
WORKSPACE = "/workspace"


class ConversionError(ValueError):
    """A source task that cannot be converted; the message names the file."""


def _copy_harbor(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, symlinks=True)


def _open_instruct(src: Path, dest: Path) -> None:
    image_txt = src / "image.txt"
    if not image_txt.is_file() or not image_txt.read_text().strip():
        raise ConversionError(f"{image_txt}: missing or empty (names the task's prebuilt image)")
    if not (src / "instruction.md").is_file():
        raise ConversionError(f"{src / 'instruction.md'}: missing")
    if not (src / "tests").is_dir():
        raise ConversionError(f"{src / 'tests'}: missing")
    image = image_txt.read_text().strip().splitlines()[0].strip()
    dest.mkdir(parents=True)
    shutil.copyfile(src / "instruction.md", dest / "instruction.md")
    shutil.copytree(src / "tests", dest / "tests", symlinks=True)
    if not (dest / "tests" / "test.sh").is_file():
        if not (dest / "tests" / "test_final_state.py").is_file():
            raise ConversionError(f"{src / 'tests'}: neither test.sh nor test_final_state.py")
        write_executable(dest / "tests" / "test.sh", TEST_SH)
        shutil.copyfile(LITE_RUNNER, dest / "tests" / "pytest_lite.py")
    env = dest / "environment"
    env.mkdir()
    lines = [f"FROM {image}"]
    seeds = src / "environment" / "seeds"
    if seeds.is_dir():
        shutil.copytree(seeds, env / "seeds", symlinks=True)
        lines.append(f"COPY seeds/ {WORKSPACE}/")
    (env / "Dockerfile").write_text("\n".join(lines + [f"WORKDIR {WORKSPACE}"]) + "\n")
    toml = {"schema_version": "1.1", "metadata": {"source": "open-instruct"},
            "environment": {"docker_image": image}}
    (dest / "task.toml").write_text(tomli_w.dumps(toml))


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


def dockerfile_from_def(text: str, setup_sh: str | None, has_fixtures: bool) -> tuple[str, dict[str, str]]:
    header, sections = def_sections(text)
    if not header.get("from"):
        raise ConversionError("container.def has no `From:` line")
    # The defs target ubuntu:22.04, whose pip installs into the system; on a Debian base
    # (the offline image map) PEP 668 would refuse the same `pip3 install`.
    lines = [f"FROM {header['from']}", "ENV DEBIAN_FRONTEND=noninteractive", "ENV PIP_BREAK_SYSTEM_PACKAGES=1"]
    for env_line in sections.get("environment", "").splitlines():
        m = re.match(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", env_line)
        if m:
            lines.append(f"ENV {m.group(1)}={m.group(2).strip()}")
    files: dict[str, str] = {}
    if has_fixtures:
        lines.append("COPY fixtures/ /app/fixtures/")
    post = sections.get("post") or (setup_sh or "")
    if post.strip():
        files["post_install.sh"] = "#!/bin/bash\nset -e\n" + post + "\n"
        lines += ["COPY post_install.sh /tmp/post_install.sh", "RUN bash /tmp/post_install.sh && rm /tmp/post_install.sh"]
    if not re.search(r"\buseradd\b", post):
        # A setup.sh delta has the standard preamble (useradd, chmod) stripped: put it back.
        lines.append(f"RUN useradd -m {AGENT_USER} && chmod -R 777 {HOME}")
    lines.append(f"WORKDIR {HOME}")
    return "\n".join(lines) + "\n", files


def _native(src: Path, dest: Path) -> None:
    meta_path = src / "task.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{meta_path}: {e}") from None
    for need in ("container.def", "test_final_state.py"):
        if not (src / need).is_file():
            raise ConversionError(f"{src / need}: missing")
    if not str(meta.get("description") or "").strip():
        raise ConversionError(f"{meta_path}: no description (the agent's instruction)")
    axis_keys = set(TaskAxes.model_fields) | {"source"}
    axes_data = normalized_axes({k: v for k, v in meta.items() if k in axis_keys and v is not None})
    axes_data.setdefault("domain", "unknown")
    axes_data.setdefault("skill_type", "unknown")
    setup = src / "setup.sh"
    fixtures = src / "fixtures"
    dockerfile, files = dockerfile_from_def((src / "container.def").read_text(),
                                            setup.read_text() if setup.is_file() else None, fixtures.is_dir())
    initial = src / "test_initial_state.py"
    parts = TaskParts(name=dest.name, axes=TaskAxes(**axes_data), instruction=meta["description"],
                      truth=str(meta.get("truth") or ""),
                      initial_test=initial.read_text() if initial.is_file() else None,
                      final_test=(src / "test_final_state.py").read_text(), dockerfile=dockerfile, env_files=files)
    write_task(parts, dest)
    if fixtures.is_dir():
        shutil.copytree(fixtures, dest / "environment" / "fixtures", symlinks=True)


_CONVERT: dict[str, Callable[[Path, Path], None]] = {"harbor": _copy_harbor, "open-instruct": _open_instruct,
                                                     "native": _native}


def _is_source_task(d: Path, fmt: str) -> bool:
    marker = {"harbor": "task.toml", "open-instruct": "instruction.md", "native": "task.json"}[fmt]
    return (d / marker).is_file()


def import_corpus(src: Path, out: Path, fmt: str,
                  on_task: Callable[[str, str | None], None] | None = None) -> dict:
    """Convert every task of `src`; {"imported": [...], "errors": {name: why}}. Each
    imported task is loaded back with `Task.load` (a task that does not load is an error)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    src = Path(src).expanduser()
    if not src.is_dir():
        raise ValueError(f"{src}: no such directory")
    dirs = [src] if _is_source_task(src, fmt) else sorted(d for d in src.iterdir() if d.is_dir()
                                                          and _is_source_task(d, fmt))
    if not dirs:
        raise ValueError(f"{src}: no {fmt} tasks found")
    out.mkdir(parents=True, exist_ok=True)
    imported, errors = [], {}
    for d in dirs:
        dest = out / d.name
        try:
            if dest.exists():
                raise ConversionError(f"{dest} already exists")
            _CONVERT[fmt](d, dest)
            Task.load(dest)
            imported.append(d.name)
            if on_task:
                on_task(d.name, None)
        except (ConversionError, TaskError, OSError, ValueError) as e:
            if dest.exists() and d.name not in imported and not isinstance(e, ConversionError | FileExistsError):
                shutil.rmtree(dest, ignore_errors=True)
            errors[d.name] = str(e)
            if on_task:
                on_task(d.name, str(e))
    return {"imported": imported, "errors": errors}
