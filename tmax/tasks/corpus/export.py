"""`tmax data export` / `tmax data import hf:PATH`: a corpus as a dataset and back.

One row per task:
    name         the task directory's name
    instruction  instruction.md
    metadata     task.toml's [metadata] as JSON (every task's own keys; a fixed column type)
    files        every file of the task directory: {path (relative, POSIX), content (bytes),
                 executable}; task.toml and instruction.md included, so a row is the whole task

Formats: `hf` (a Hugging Face `datasets` directory, `save_to_disk`), `parquet` (one file of
the same rows) and `tar` (a gzipped tarball of the Harbor task directories). `hf` and
`parquet` need the `data` extra (datasets, pyarrow). Import rebuilds each task directory
byte for byte and loads it back; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from tmax.tasks.corpus.corpus import read_corpus
from tmax.tasks.corpus.package import replace_dir
from tmax.tasks.task_format import Task, TaskError

EXPORT_FORMATS = ("hf", "parquet", "tar")
DATASET_PREFIXES = ("hf:", "parquet:")


class ExportError(ValueError):
    pass


def task_row(task_dir: Path, metadata: dict, instruction: str) -> dict:
    files = []
    for p in sorted(task_dir.rglob("*")):
        if p.is_file() and not p.is_symlink():
            files.append({"path": p.relative_to(task_dir).as_posix(), "content": p.read_bytes(),
                          "executable": os.access(p, os.X_OK)})
    return {"name": task_dir.name, "instruction": instruction, "metadata": json.dumps(metadata, sort_keys=True),
            "files": files}


def export_corpus(root: Path, out: Path, fmt: str) -> dict:
    """Write every readable task of `root` to `out`; {"exported": n, "unreadable": {...}}."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    corpus = read_corpus(root)
    if fmt == "tar":
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            for t in corpus:
                tar.add(t.path, arcname=t.name)
        return {"exported": len(corpus), "out": str(out), "unreadable": corpus.unreadable}
    import datasets  # the data extra; without it the CLI names the extra

    rows = [task_row(t.path, t.metadata, t.instruction) for t in corpus]
    ds = datasets.Dataset.from_list(rows)
    if fmt == "hf":
        ds.save_to_disk(str(out))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(out))
    return {"exported": len(rows), "out": str(out), "unreadable": corpus.unreadable}


def _safe(rel: str, name: str) -> Path:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts:
        raise ExportError(f"row {name}: file path {rel!r} is not inside the task")
    return Path(*p.parts)


def write_row(row: dict, out: Path) -> Path:
    """Rebuild one task directory from its row (atomically) and load it."""
    name = str(row.get("name") or "")
    if not name or "/" in name or name.startswith("."):
        raise ExportError(f"row name {name!r} is not a task directory name")
    tmp = out / f".{name}.import"
    for f in row.get("files") or []:
        target = tmp / _safe(f["path"], name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f["content"])
        if f.get("executable"):
            target.chmod(0o755)
    dest = out / name
    if dest.exists():
        raise ExportError(f"{dest} already exists")
    replace_dir(tmp, dest)
    return dest


def import_dataset(spec: str, out: Path) -> dict:
    """`hf:DIR` (a saved dataset) or `parquet:FILE` to task directories under `out`;
    {"imported": [...], "errors": {name: why}} like the layout importers."""
    kind, _, path = spec.partition(":")
    import datasets  # the data extra; without it the CLI names the extra

    try:
        ds = datasets.load_from_disk(path) if kind == "hf" else datasets.Dataset.from_parquet(path)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"{spec}: cannot read the dataset: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    imported, errors = [], {}
    for row in ds:
        dest = None
        try:
            dest = write_row(row, out)
            Task.load(dest)
            imported.append(row["name"])
        except (ExportError, TaskError, OSError) as e:
            if dest is not None:
                shutil.rmtree(dest, ignore_errors=True)
            shutil.rmtree(out / f".{row.get('name')}.import", ignore_errors=True)
            errors[str(row.get("name"))] = str(e)
    return {"imported": imported, "errors": errors}
