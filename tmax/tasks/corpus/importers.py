"""`tmax data import`: the published corpus layouts, converted to Harbor tasks.

harbor         the Harbor export: task directories with the axes in `[metadata]`;
               copied as they are (each must load), `[agent] user` included
open-instruct  the RL training copy: per-task folders and optional dataset rows
               (`tasks.corpus.import_open_instruct` documents the layout)
native         the generator's own layout (`tasks.corpus.import_native`)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from tmax.tasks.corpus import import_native, import_open_instruct
from tmax.tasks.task_format import Task, TaskError

FORMATS = ("harbor", "open-instruct", "native")


class ConversionError(ValueError):
    """A source task that cannot be converted; the message names the file."""


_SOURCE_ERRORS = (ConversionError, import_native.NativeError, import_open_instruct.OpenInstructError)


def _is_source_task(d: Path, fmt: str) -> bool:
    if fmt == "open-instruct":
        return import_open_instruct.is_task_folder(d)
    return (d / {"harbor": "task.toml", "native": "task.json"}[fmt]).is_file()


def _source_dirs(src: Path, fmt: str) -> list[Path]:
    if _is_source_task(src, fmt):
        return [src]
    return sorted(d for d in src.iterdir() if d.is_dir() and _is_source_task(d, fmt))


def _converter(fmt: str, src: Path) -> tuple[Callable[[Path, Path], None], dict[str, str]]:
    """(convert(source dir, dest), errors found before any task: rows without a folder)."""
    if fmt == "harbor":
        return (lambda s, d: shutil.copytree(s, d, symlinks=True)), {}
    if fmt == "native":
        return import_native.convert, {}
    rows = import_open_instruct.read_rows(src) if src.is_dir() else {}
    folders = {d.name for d in _source_dirs(src, fmt)}
    orphans = {tid: f"dataset row with env_config.task_id {tid!r}: no task folder {src / tid} (its tests/ are "
                    "needed)" for tid in rows if tid not in folders}
    return (lambda s, d: import_open_instruct.convert(s, d, rows.get(s.name))), orphans


def import_corpus(src: Path, out: Path, fmt: str,
                  on_task: Callable[[str, str | None], None] | None = None) -> dict:
    """Convert every task of `src`; {"imported": [...], "errors": {name: why}}. Each
    imported task is loaded back with `Task.load` (a task that does not load is an error)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    src = Path(src).expanduser()
    if not src.is_dir():
        raise ValueError(f"{src}: no such directory")
    dirs = _source_dirs(src, fmt)
    convert, errors = _converter(fmt, src)
    if not dirs:
        raise ValueError(f"{src}: no {fmt} tasks found")
    out.mkdir(parents=True, exist_ok=True)
    imported: list[str] = []
    for name, why in errors.items():
        if on_task:
            on_task(name, why)
    for d in dirs:
        dest = out / d.name
        # Converted beside `dest` and renamed into place once it loads: a killed import
        # leaves no half-written task under its real name.
        staging = out / f".{d.name}.importing"
        try:
            if dest.exists():
                raise ConversionError(f"{dest} already exists")
            shutil.rmtree(staging, ignore_errors=True)
            convert(d, staging)
            Task.load(staging)
            staging.rename(dest)
            imported.append(d.name)
            if on_task:
                on_task(d.name, None)
        except (*_SOURCE_ERRORS, TaskError, OSError, ValueError) as e:
            shutil.rmtree(staging, ignore_errors=True)
            errors[d.name] = str(e).replace(str(staging), str(dest))
            if on_task:
                on_task(d.name, errors[d.name])
    return {"imported": imported, "errors": errors}
