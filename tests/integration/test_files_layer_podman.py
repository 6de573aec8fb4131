"""Tasks that are a base image plus files, served unbuilt (`tasks.files_layer`): an episode of a
container of the base image, the files written into its root, has the filesystem a container
of the built image has under the copied paths and the WORKDIR (entries, contents, modes,
owners, the mtimes COPY keeps), starts where it does and sees its image's environment; the
oracle passes and nop fails through `tmax bench` both ways; a Dockerfile that is more than
that is built as before.

Real podman and `podman build`; a nano task and Terminal-Bench 2.0 sample tasks of that
shape, read in place."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tmax.sandbox.base import IMAGE_USER, LayerCopy, LayerDir
from tmax.sandbox.overlay_pool import OverlayPool
from tmax.tasks.episode import EnvSettings, Episode
from tmax.tasks.task_images import TaskImage, ensure_image, image_id
from tmax.tasks.task_format import Task
from tmax.tasks.offline import default_config

pytestmark = pytest.mark.podman

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "tb2-sample"
needs_sample = pytest.mark.skipif(not SAMPLE.is_dir(), reason="tb2 sample not present")
TEST_LABEL = "io.tmax.test-files-layer"
# Each entry under the given paths: type, mode, owner, size, mtime in whole seconds.
LIST = "find {paths} -printf '%p %y %m %U:%G %s %T@\\n' | sort; find {paths} -type f -exec sha256sum {{}} + | sort -k2"


@pytest.fixture(scope="module")
def task_root(tmp_path_factory, base_image) -> Path:
    from tmax.training.nano.tasks import write_splits

    root = tmp_path_factory.mktemp("files-layer")
    write_splits(root / "nano", 1, 0, seed=0)
    # A seed file of every kind COPY handles: a read-only file, an executable, a private
    # directory with an old mtime, an empty one.
    [nano] = sorted((root / "nano" / "train").iterdir())
    files = nano / "environment" / "files"
    (files / "bin").mkdir(mode=0o750)
    (files / "bin" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (files / "bin" / "run.sh").chmod(0o755)
    (files / "ro.txt").write_text("read only\n")
    (files / "ro.txt").chmod(0o444)
    (files / "empty").mkdir(mode=0o700)
    # Fixed mtimes: a cached build of this task (its tag covers contents, not mtimes) has
    # the same. COPY keeps them to the nearest second: one rounds up, one down.
    for p, when in [*((p, "2022-05-06 07:08:09") for p in files.rglob("*")), (files / "bin", "2020-01-02 03:04:05"),
                    (files / "ro.txt", "2021-03-04 05:06:07.7"), (files / "bin" / "run.sh", "2021-03-04 05:06:07.3")]:
        subprocess.run(["touch", "-d", when, str(p)], check=True)
    return root


@pytest.fixture(scope="module")
def pool(task_root):
    label = {TEST_LABEL: uuid.uuid4().hex[:12]}
    p = OverlayPool(2, host_labels=label, root=task_root / "hosts", close_in_background=False)
    yield p
    p.close(in_use=True)
    from tmax.sandbox.cleanup import remove_labelled

    remove_labelled(label)


def _nano(task_root: Path) -> Path:
    return next((task_root / "nano" / "train").iterdir())


def _settings(files_layer: bool) -> EnvSettings:
    return EnvSettings(rewrite=default_config([]), files_layer=files_layer)


def _listing(sb, paths: list[str]) -> dict[str, list]:
    """path -> [type, mode, owner, size, mtime, sha256 of a file's contents]."""
    r = sb.exec(["bash", "-c", LIST.format(paths=" ".join(paths))], timeout=60, user=IMAGE_USER)
    assert r.exit_code == 0, r.stderr
    out: dict[str, list] = {}
    for line in r.output.splitlines():
        if line.startswith("/"):
            path, kind, mode, owner, size, mtime = line.split()
            out[path] = [kind, mode, owner, size, int(float(mtime)), None]
        else:
            sha, path = line.split(maxsplit=1)
            out[path][5] = sha
    return out


def _image_env(tag: str) -> dict[str, str]:
    out = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Config.Env}}", tag],
                         capture_output=True, text=True, check=True).stdout
    return dict(v.split("=", 1) for v in json.loads(out))


def _seconds(p: Path) -> int:
    """A source's mtime as COPY keeps it: to the nearest second."""
    return (p.stat().st_mtime_ns + 500_000_000) // 1_000_000_000


def _mtimes_from_sources(image: TaskImage, listed: dict[str, list]) -> dict[str, int]:
    """Where each copied file and source directory lands inside (`listed`: the built image's
    entries), with its source's mtime."""
    out: dict[str, int] = {}
    for step in image.files.steps:
        if not isinstance(step, LayerCopy):
            continue
        for src in map(Path, step.sources):
            if src.is_dir():
                out.update({f"{step.dest.rstrip('/')}/{p.relative_to(src)}": _seconds(p)
                            for p in src.rglob("*")})
            elif listed[step.dest][0] == "d":
                out[f"{step.dest.rstrip('/')}/{src.name}"] = _seconds(src)
            else:
                out[step.dest] = _seconds(src)
    return out


def _seen(sb, paths: list[str]) -> dict:
    """What an episode shows of the environment: the listing, where its shell and a process
    start, and its environment."""
    env = dict(line.split("=", 1) for line in sb.exec(["env"], timeout=30, user=IMAGE_USER).output.splitlines()
               if "=" in line)
    return {"listing": _listing(sb, paths), "shell_pwd": sb.run("pwd", timeout=30).output.strip(),
            "exec_pwd": sb.exec(["pwd"], timeout=30).output.strip(), "env": env}


def _tasks(task_root: Path) -> list[Path]:
    names = ["merge-diff-arc-agi-task", "adaptive-rejection-sampler", "sparql-university"]
    return [_nano(task_root)] + ([SAMPLE / n for n in names] if SAMPLE.is_dir() else [])


@pytest.mark.parametrize("which", range(4))
def test_the_episode_has_the_built_images_files(pool, task_root, which):
    tasks = _tasks(task_root)
    if which >= len(tasks):
        pytest.skip("tb2 sample not present")
    task = Task.load(tasks[which])
    layer = ensure_image(task, default_config([]), files_layer=True, use_prebuilt=False)
    # Built now, from these sources: a cached image of the same tag (its tag covers contents,
    # not mtimes) keeps the mtimes its sources had then, and the sample's files are rewritten
    # with new mtimes whenever the sample is copied.
    built = ensure_image(task, default_config([]), use_prebuilt=False, force=True)
    assert layer.files is not None and not layer.built and built.files is None
    assert layer.tag == built.tag and layer.workdir == built.workdir  # one identity, one start dir
    assert layer.base_id == image_id("localhost/tmax-base:bookworm")
    # The WORKDIRs, the COPY destinations and the directories made for them.
    paths = sorted({p for s in layer.files.steps
                    for p in ([s.path] if isinstance(s, LayerDir) else [s.dest, str(Path(s.dest).parent)])} - {"/"})
    with Episode(task, _settings(True), image=layer, pool=pool) as ep:
        ep.open()
        assert ep.sandbox_mode == "overlay+files"
        got = _seen(ep.sandbox, paths)
    with Episode(task, _settings(False), image=built) as ep:
        ep.open()
        assert ep.sandbox_mode == "container"
        want = _seen(ep.sandbox, paths)
    sources = _mtimes_from_sources(layer, want["listing"])
    assert sources and set(sources) <= set(want["listing"])
    for path in sources:  # COPY keeps the source's mtime, to the second; a directory it made has its own
        assert got["listing"][path][4] == want["listing"][path][4] == sources[path], path
    for entries in (got["listing"], want["listing"]):
        for entry in entries.values():
            del entry[4]
    assert got["listing"] == want["listing"]  # the same entries, kinds, modes, owners, sizes, contents
    assert {entry[2] for entry in want["listing"].values()} == {"0:0"}
    assert got["shell_pwd"] == got["exec_pwd"] == want["shell_pwd"] == want["exec_pwd"] == built.workdir
    image_env = _image_env(built.tag)
    assert {k: got["env"].get(k) for k in image_env} == {k: want["env"].get(k) for k in image_env} == image_env


def test_a_dockerfile_with_more_is_built_and_its_episodes_overlay_its_image(pool, task_root, tmp_path):
    d = tmp_path / "built-task"
    shutil.copytree(_nano(task_root), d)
    (d / "environment" / "Dockerfile").write_text(
        "FROM localhost/tmax-base:bookworm\nWORKDIR /app\nCOPY files/ ./\nRUN echo made > /built\n")
    task = Task.load(d)
    image = ensure_image(task, default_config([]), files_layer=True)
    assert image.files is None and image_id(image.tag) is not None
    with Episode(task, _settings(True), image=image, pool=pool) as ep:
        ep.open()
        assert ep.sandbox_mode == "overlay"
        assert ep.sandbox.run("cat /built", timeout=30).output.strip() == "made"


def test_the_fallback_of_a_files_layer_is_its_built_image(task_root, tmp_path):
    task = Task.load(_nano(task_root))
    layer = ensure_image(task, default_config([]), files_layer=True)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a host registry others could write: the overlay refuses it, episodes fall back
    with OverlayPool(1, root=shared, close_in_background=False) as fallback_pool:
        with Episode(task, _settings(True), image=layer, pool=fallback_pool) as ep:
            ep.open()
            assert ep.sandbox_mode == "container" and fallback_pool.fallbacks
            assert ep.sandbox.image == ensure_image(task, default_config([])).tag  # built when it was needed
            assert ep.sandbox.run("cat *.dat | wc -l", timeout=30).output.strip() != "0"


# -- through `tmax bench`: both ways -----------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(task_root) -> Path:
    d = task_root / "dataset"
    d.mkdir()
    (d / _nano(task_root).name).symlink_to(_nano(task_root))
    if SAMPLE.is_dir():
        (d / "regex-log").symlink_to(SAMPLE / "regex-log")  # read in place
    return d


@pytest.mark.slow
@pytest.mark.parametrize("overlay,mode", [(True, "overlay+files"), (False, "container")])
@pytest.mark.parametrize("agent,reward", [("oracle", 1.0), ("nop", 0.0)])
def test_oracle_passes_and_nop_fails_both_ways(tmp_path, dataset, overlay, mode, agent, reward):
    from tmax.tasks.job import Job, JobSpec

    names = sorted(p.name for p in dataset.iterdir())
    job = Job(JobSpec(job_name=f"files-{agent}-{overlay}", jobs_dir=str(tmp_path), dataset=str(dataset),
                        agent=agent, n_concurrent=len(names), overlay=overlay))
    job.run()
    results = {t.task_name: t for t in job.results()}
    assert sorted(results) == names
    for name, t in results.items():
        assert t.score().reward == reward, (name, t.exception_info)
        assert t.tmax.sandbox_mode == mode and t.tmax.image_built is not None, name
