"""`tmax sandbox prune` and `--disk-budget-gb`: task images tmax built, least recently used
first, down to a size. Only these tests' own images are ever candidates: they carry a label
unique to the run, and the pruning is narrowed to it (--label, $TMAX_IMAGE_LABELS)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmax.sandbox.base import LABEL_KEY, LABEL_VALUE
from tmax.sandbox.base_image import image_exists
from tmax.tasks.task_images import BASE_TAG, TASK_LABEL, record_use, task_images
from tmax.cli.main import app

pytestmark = pytest.mark.podman


def _build(tag: str, test_label: str, ctx) -> None:
    (ctx / "Dockerfile").write_text(f"FROM {BASE_TAG}\nRUN echo {tag} > /built-by-test\n")
    r = subprocess.run(["podman", "build", "-q", "-t", tag, "--label", f"{LABEL_KEY}={LABEL_VALUE}",
                        "--label", f"{TASK_LABEL}={tag.rsplit(':', 1)[1]}", "--label", test_label, str(ctx)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("podman") is None or not image_exists(BASE_TAG), reason="needs podman and the base image")
def test_prune_removes_the_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TMAX_CACHE_DIR", str(tmp_path / "cache"))
    run = uuid.uuid4().hex[:10]
    label = f"io.tmax.test={run}"
    tags = [f"localhost/tmax-test-prune-{run}:img{i}" for i in range(3)]
    try:
        for t in tags:
            _build(t, label, tmp_path)
        for t in (tags[0], tags[1], tags[2], tags[0]):  # img1 is now the least recently used
            record_use(t)
            time.sleep(0.02)
        mine = task_images({"io.tmax.test": run})
        assert [i.names[0] for i in mine] == [tags[1], tags[2], tags[0]]
        size = {i.names[0]: i.size for i in mine}
        keep = (size[tags[2]] + size[tags[0]] + 1000) / 1e9
        r = CliRunner().invoke(app, ["sandbox", "prune", "--keep-gb", f"{keep:.9f}", "--label", label, "--dry-run",
                                     "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["removed"] == [tags[1]] and image_exists(tags[1])
        r = CliRunner().invoke(app, ["sandbox", "prune", "--keep-gb", f"{keep:.9f}", "--label", label, "--json"])
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        assert data["removed"] == [tags[1]] and set(data["kept"]) == {tags[0], tags[2]}
        assert not image_exists(tags[1]) and image_exists(tags[0]) and image_exists(tags[2])
        assert image_exists(BASE_TAG)
    finally:
        for t in tags:
            subprocess.run(["podman", "rmi", "-f", t], capture_output=True, timeout=120)
    assert os.environ["TMAX_CACHE_DIR"] == str(tmp_path / "cache")


@pytest.mark.skipif(shutil.which("podman") is None or not image_exists(BASE_TAG), reason="needs podman and the base image")
def test_disk_budget_of_validate_prunes_the_least_recently_used_of_its_own_images(tmp_path, monkeypatch):
    """`validate --disk-budget-gb` with room for one task image: after each task the older
    images go and the newest stays. $TMAX_IMAGE_LABELS labels the images this run builds and
    scopes the pruning to them, so no other image on the store is ever a candidate."""
    run = uuid.uuid4().hex[:10]
    monkeypatch.setenv("TMAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TMAX_IMAGE_LABELS", f"io.tmax.test={run}")
    assert task_images() == []  # the scope holds none of the store's other images
    good = Path(__file__).parents[1] / "data" / "corpus" / "validate" / "good"
    names = [f"lru-{i}" for i in range(3)]
    for name in names:
        shutil.copytree(good, tmp_path / "corpus" / name)
        (tmp_path / "corpus" / name / "tests" / "test_initial_state.py").unlink()  # the base has no python3
        with open(tmp_path / "corpus" / name / "environment" / "Dockerfile", "a") as f:
            f.write(f"RUN echo {run}-{name} > /built-by-test\n")  # one image per task
    base = json.loads(subprocess.run(["podman", "image", "inspect", BASE_TAG], capture_output=True, text=True,
                                     check=True).stdout)[0]["Size"]
    budget = 1.5 * base / 1e9  # a task image is the base plus a few bytes: one fits, two do not
    try:
        r = CliRunner().invoke(app, ["data", "validate", str(tmp_path / "corpus"), "-e", "podman", "-n", "1",
                                     "--disk-budget-gb", f"{budget:.9f}", "--jsonl"])
        assert r.exit_code == 0, r.output
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        done = [x["task"] for x in lines if "task" in x]
        assert sorted(done) == names and all(x["verdict"] == "ok" for x in lines if "task" in x)
        left = task_images()
        assert [i.names[0].split("/")[-1].split(":")[0] for i in left] == [done[-1]]
        assert image_exists(BASE_TAG)
    finally:
        ids = subprocess.run(["podman", "images", "-q", "--filter", f"label=io.tmax.test={run}"],
                             capture_output=True, text=True, timeout=120).stdout.split()
        for i in ids:
            subprocess.run(["podman", "rmi", "-f", i], capture_output=True, timeout=120)


def test_a_malformed_image_scope_is_named(monkeypatch):
    monkeypatch.setenv("TMAX_IMAGE_LABELS", "io.tmax.test=a,oops")
    r = CliRunner().invoke(app, ["sandbox", "prune", "--dry-run"])
    assert r.exit_code == 1 and "TMAX_IMAGE_LABELS: 'oops': expected KEY=VALUE" in r.output
