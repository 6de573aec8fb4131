"""`tmax data import --format open-instruct`: the RL training copy of a corpus.

The published layout (the `tmax-15k-open-instruct` tarball and its dataset rows):

    SRC/<task_id>/instruction.md        what the agent sees (optional when a row gives it)
    SRC/<task_id>/tests/                test_final_state.py (+ test.sh), uploaded at submit time
    SRC/<task_id>/environment/seeds/    optional: files uploaded to /workspace
    SRC/<task_id>/image.txt             optional: the task's prebuilt image
    SRC/<task_id>/setup.sh              optional (or environment/setup.sh): the def's %post, the
                                        whole environment (apt installs, seed files, useradd)
    SRC/*.jsonl | *.parquet             optional dataset rows, one per task:
        messages      [{role, content}]: the user turn is the instruction
        ground_truth  string, kept as metadata
        dataset       the row's dataset name, kept
        env_config    {env_name, image, task_id}: task_id names the folder, image the prebuilt image
        source        kept

The image comes from the row's `env_config.image`, else `image.txt`. With a `setup.sh`
the Dockerfile is the environment itself (FROM ubuntu:22.04, the script as a RUN step,
the seeds), and the prebuilt image is `docker_image`, used when it can be pulled; without
one the Dockerfile is FROM the prebuilt image. A task with neither is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tomli_w

from tmax.tasks.corpus.package import LITE_RUNNER, TEST_SH, write_executable

WORKSPACE = "/workspace"
SETUP_BASE = "ubuntu:22.04"  # what the original defs bootstrap from
ROW_SUFFIXES = (".jsonl", ".parquet")


class OpenInstructError(ValueError):
    """A source task or row that cannot be converted; the message names the file."""


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OpenInstructError(f"{path}: reading parquet rows needs pyarrow (pip install 'tmax[data]')") from None
    return pq.read_table(path).to_pylist()


def read_rows(src: Path) -> dict[str, dict]:
    """{task_id: row} of every row file directly under `src`."""
    rows: dict[str, dict] = {}
    for path in sorted(p for p in src.iterdir() if p.is_file() and p.suffix in ROW_SUFFIXES):
        if path.suffix == ".parquet":
            items = list(enumerate(_parquet_rows(path), 1))
        else:
            items = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                     if line.strip()]
        for n, item in items:
            try:
                row = json.loads(item) if isinstance(item, str) else item
                task_id = str(row["env_config"]["task_id"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise OpenInstructError(f"{path} row {n}: not an open-instruct row with env_config.task_id ({e})") \
                    from None
            rows[task_id] = row
    return rows


def is_task_folder(d: Path) -> bool:
    """A task folder has its tests; everything else may come from its row."""
    return (d / "tests").is_dir()


def _instruction(src: Path, row: dict | None) -> str:
    if (src / "instruction.md").is_file():
        return (src / "instruction.md").read_text(encoding="utf-8")
    users = [m.get("content") for m in (row or {}).get("messages") or [] if m.get("role") == "user"]
    if users and isinstance(users[-1], str) and users[-1].strip():
        return users[-1]
    raise OpenInstructError(f"{src / 'instruction.md'}: missing, and no dataset row gives a user message")


def _image(src: Path, row: dict | None) -> str | None:
    image = ((row or {}).get("env_config") or {}).get("image")
    if isinstance(image, str) and image.strip():
        return image.strip()
    txt = src / "image.txt"
    if txt.is_file() and txt.read_text().strip():
        return txt.read_text().strip().splitlines()[0].strip()
    return None


def _setup_script(src: Path) -> Path | None:
    for p in (src / "setup.sh", src / "environment" / "setup.sh"):
        if p.is_file():
            return p
    return None


def dockerfile(image: str | None, setup: str | None, has_seeds: bool) -> tuple[str, dict[str, str]]:
    """(Dockerfile, build-context files) of one task."""
    files: dict[str, str] = {}
    if setup is not None:
        # The defs target ubuntu:22.04, whose pip installs into the system; on a Debian base
        # (the offline image map) PEP 668 would refuse the same `pip3 install`.
        lines = [f"FROM {SETUP_BASE}", "ENV DEBIAN_FRONTEND=noninteractive", "ENV PIP_BREAK_SYSTEM_PACKAGES=1",
                 "COPY setup.sh /tmp/tmax-setup.sh", "RUN bash -e /tmp/tmax-setup.sh && rm /tmp/tmax-setup.sh"]
        files["setup.sh"] = setup
    elif image:
        lines = [f"FROM {image}"]
    else:
        raise OpenInstructError("no image (env_config.image of its row, or image.txt) and no setup.sh: nothing "
                                "describes the task's environment")
    if has_seeds:
        lines.append(f"COPY seeds/ {WORKSPACE}/")
    lines.append(f"WORKDIR {WORKSPACE}")
    return "\n".join(lines) + "\n", files


def _metadata(row: dict | None, task_id: str) -> dict:
    meta: dict = {"source": "open-instruct", "task_id": task_id}
    if not row:
        return meta
    env = row.get("env_config") or {}
    for key, value in (("env_name", env.get("env_name")), ("dataset", row.get("dataset")),
                       ("row_source", row.get("source")), ("ground_truth", row.get("ground_truth"))):
        if value is not None:
            meta[key] = value if isinstance(value, str) else json.dumps(value)
    return meta


def convert(src: Path, dest: Path, row: dict | None) -> None:
    """One task folder (and its row, if any) to a Harbor task at `dest`."""
    if not (src / "tests").is_dir():
        raise OpenInstructError(f"{src / 'tests'}: missing")
    instruction = _instruction(src, row)
    image = _image(src, row)
    setup_path = _setup_script(src)
    seeds = src / "environment" / "seeds"
    try:
        text, files = dockerfile(image, setup_path.read_text() if setup_path else None, seeds.is_dir())
    except OpenInstructError as e:
        raise OpenInstructError(f"{src}: {e}") from None
    dest.mkdir(parents=True)
    (dest / "instruction.md").write_text(instruction.strip() + "\n")
    shutil.copytree(src / "tests", dest / "tests", symlinks=True)
    if not (dest / "tests" / "test.sh").is_file():
        if not (dest / "tests" / "test_final_state.py").is_file():
            raise OpenInstructError(f"{src / 'tests'}: neither test.sh nor test_final_state.py")
        write_executable(dest / "tests" / "test.sh", TEST_SH)
        shutil.copyfile(LITE_RUNNER, dest / "tests" / "pytest_lite.py")
    env = dest / "environment"
    env.mkdir()
    if seeds.is_dir():
        shutil.copytree(seeds, env / "seeds", symlinks=True)
    for rel, content in files.items():
        (env / rel).write_text(content)
    (env / "Dockerfile").write_text(text)
    toml: dict = {"schema_version": "1.1", "metadata": _metadata(row, src.name)}
    if image:
        toml["environment"] = {"docker_image": image}
    (dest / "task.toml").write_text(tomli_w.dumps(toml))
