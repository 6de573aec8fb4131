"""Which Dockerfiles are a base image plus files (`tasks.files_layer`), and their steps; every
other one is built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tmax.sandbox.base import LayerCopy, LayerDir
from tmax.tasks.files_layer import LayerPlan, NotALayer, plan_layer, task_layer
from tmax.tasks.task_format import Task
from tmax.tasks.offline import Patch, default_config

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "tb2-sample"
BASE = "localhost/tmax-base:bookworm"
needs_sample = pytest.mark.skipif(not SAMPLE.is_dir(), reason="tb2 sample not present")
CFG = default_config([], ca_bundle=False)


@pytest.fixture
def ctx(tmp_path: Path) -> Path:
    (tmp_path / "files" / "sub").mkdir(parents=True)
    (tmp_path / "files" / "in.dat").write_text("x\n")
    (tmp_path / "files" / "sub" / "b.txt").write_text("b\n")
    (tmp_path / "code.png").write_bytes(b"\x89PNG")
    (tmp_path / "a b.txt").write_text("spaced\n")
    return tmp_path


def plan(text: str, ctx: Path) -> LayerPlan | NotALayer:
    return plan_layer(text, ctx, CFG)


def test_the_nano_shape_is_a_layer(ctx):
    got = plan(f"FROM {BASE}\nWORKDIR /app\nCOPY files/ ./\n", ctx)
    assert got == LayerPlan(BASE, (LayerDir("/app"), LayerCopy((str(ctx / "files"),), "/app", True)), "/app")


def test_destinations_resolve_against_the_workdir_in_order(ctx):
    text = (f"FROM {BASE}\n# a comment\nWORKDIR /app\nCOPY code.png /app\nCOPY code.png .\nWORKDIR sub/../w\n"
            "COPY [\"a b.txt\", \"files/in.dat\", \"out/\"]\nCOPY /files/. /data/\n")
    got = plan(text, ctx)
    png, spaced, dat = (str(ctx / n) for n in ("code.png", "a b.txt", "files/in.dat"))
    assert got == LayerPlan(BASE, (
        LayerDir("/app"), LayerCopy((png,), "/app", False), LayerCopy((png,), "/app", False), LayerDir("/app/w"),
        LayerCopy((spaced, dat), "/app/w/out", True), LayerCopy((str(ctx / "files"),), "/data", True)), "/app/w")


def test_no_workdir_leaves_the_base_images(ctx):
    got = plan(f"FROM {BASE}\nCOPY code.png /opt/x.png\n", ctx)
    assert got == LayerPlan(BASE, (LayerCopy((str(ctx / "code.png"),), "/opt/x.png", False),), None)


def test_the_offline_map_target_is_the_base_and_its_workdir_a_step(ctx):
    got = plan("FROM ubuntu:24.04\nWORKDIR /app\nCOPY code.png .\n", ctx)
    assert isinstance(got, LayerPlan) and got.base == BASE
    assert got.steps[:2] == (LayerDir("/"), LayerDir("/app"))


@pytest.mark.parametrize("text,why", [
    (f"FROM {BASE}\nRUN true\n", "RUN"),
    (f"FROM {BASE}\nENV A=1\n", "ENV"),
    (f"FROM {BASE}\nUSER nobody\n", "USER"),
    (f"FROM {BASE}\nADD code.png /x\n", "ADD"),
    (f"FROM {BASE} AS a\nFROM a\nCOPY code.png /x\n", "FROM"),
    (f"FROM {BASE} AS a\nCOPY --from=a /etc/hostname /x\n", "flags"),
    (f"FROM {BASE}\nCOPY --chown=1000 code.png /x\n", "flags"),
    (f"FROM {BASE}\nCOPY --chmod=600 code.png /x\n", "flags"),
    (f"FROM {BASE}\nCOPY <<EOF /x\nhi\nEOF\n", "heredoc"),
    (f"FROM {BASE}\nCOPY *.png /x/\n", "globs"),
    (f"FROM {BASE}\nARG D=/x\nCOPY code.png $D\n", "ARG"),
    ("ARG B=" + BASE + "\nFROM $B\n", "FROM"),
    (f"FROM --platform=linux/amd64 {BASE}\n", "flags"),
    ("FROM python:3.13-slim-bookworm\nWORKDIR /app\n", "build steps"),  # the map's setup runs apt-get
    (f"FROM {BASE}\nCOPY code.png files/in.dat /x\n", "ending in /"),
    (f"FROM {BASE}\nCOPY code.png x\n", "depends on the base"),
    (f"FROM {BASE}\nWORKDIR rel\n", "depends on the base"),
    (f"FROM {BASE}\nWORKDIR /app\nCOPY ../secret /x\n", "outside the build context"),
    (f"FROM {BASE}\nWORKDIR /app\nCOPY missing.txt /x\n", "no such file"),
])
def test_everything_else_is_built(ctx, text, why):
    got = plan(text, ctx)
    assert isinstance(got, NotALayer) and why in got.reason, got


def test_large_files_are_built(ctx, monkeypatch):
    import tmax.tasks.files_layer as fl

    assert isinstance(plan(f"FROM {BASE}\nCOPY files/ /app/\n", ctx), LayerPlan)
    monkeypatch.setattr(fl, "MAX_LAYER_BYTES", 3)  # the two seed files hold 4 bytes
    assert "bytes of files" in plan(f"FROM {BASE}\nCOPY files/ /app/\n", ctx).reason


def test_links_and_special_files_in_a_source_are_built(ctx):
    os.symlink("in.dat", ctx / "files" / "link")
    assert "symlink" in plan(f"FROM {BASE}\nCOPY files/ /app/\n", ctx).reason
    (ctx / "files" / "link").unlink()
    os.link(ctx / "files" / "in.dat", ctx / "hard.dat")
    assert "hard links" in plan(f"FROM {BASE}\nCOPY files/ /app/\n", ctx).reason
    (ctx / "hard.dat").unlink()
    os.mkfifo(ctx / "files" / "sub" / "fifo")
    assert "not a regular file" in plan(f"FROM {BASE}\nCOPY files/ /app/\n", ctx).reason


def _task(root: Path, dockerfile: str) -> Task:
    from tmax.training.nano.tasks import write_splits

    [d] = write_splits(root, 1, 0, seed=0)["train"]
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    return Task.load(d)


def test_a_dockerignore_or_a_patched_context_is_built(tmp_path):
    text = f"FROM {BASE}\nWORKDIR /app\nCOPY files/ ./\n"
    task = _task(tmp_path, text)
    assert isinstance(task_layer(task, text, CFG), LayerPlan)
    patched = default_config([], ca_bundle=False)
    patched.patches.append(Patch(task.name, "environment/files/x", "a", "b"))
    assert "patched" in task_layer(task, text, patched).reason
    (task.environment_dir / ".dockerignore").write_text("*.dat\n")
    assert ".dockerignore" in task_layer(task, text, CFG).reason


@needs_sample
@pytest.mark.parametrize("name,layer", [
    ("regex-log", True), ("dna-insert", True), ("merge-diff-arc-agi-task", True), ("sparql-university", True),
    ("adaptive-rejection-sampler", True), ("code-from-image", False), ("polyglot-c-py", False),
    ("financial-document-processor", False),
])
def test_tb2_sample_tasks(name, layer):
    task = Task.load(SAMPLE / name)
    got = task_layer(task, task.dockerfile.read_text(), default_config([]))
    assert isinstance(got, LayerPlan) == layer, got
