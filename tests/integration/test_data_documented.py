"""The `tmax data` lines of docs/data.md and README.md, run exactly as a page writes them
(`documented`), in a working directory laid out as the lines expect (data/mine, ../shared/...),
on the small hand-made corpora of test_data_corpus.py. What each line must leave is checked;
the counts and the algorithms are test_data_corpus.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from documented import documented
from tmax.cli.main import app
from tmax.tasks.task_format import Task

DATA = Path(__file__).parents[1] / "data" / "corpus"


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """A working directory with ../shared/tb2-sample (the benchmark tasks decontam compares with)."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "tb2-sample").symlink_to(DATA / "bench")
    cwd = tmp_path / "work"
    (cwd / "data").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    return cwd


def tmax(argv: list[str]):
    assert argv[0] == "tmax"
    result = CliRunner().invoke(app, argv[1:])
    assert result.exit_code == 0, result.output[-3000:]
    return result


def test_report_decontam_and_combine_as_typed(work):
    shutil.copytree(DATA / "report", work / "data" / "mine")
    tmax(documented("tmax data report data/mine --png report.png"))
    assert (work / "report.png").read_bytes()[:4] == b"\x89PNG"

    shutil.rmtree(work / "data" / "mine")
    shutil.copytree(DATA / "decontam", work / "data" / "mine")
    tmax(documented("tmax data decontam data/mine --against ../shared/tb2-sample --drop data/mine-clean"))
    assert sorted(p.name for p in (work / "data" / "mine-clean").iterdir()) == ["clean", "near-miss"]

    shutil.copytree(DATA / "report", work / "data" / "legacy")
    shutil.copytree(DATA / "decontam", work / "data" / "v2")
    tmax(documented("tmax data combine data/legacy data/v2 -o data/all --mode balanced --total 2500"))
    combined = sorted((work / "data" / "all").iterdir())
    assert combined and all(p.is_symlink() for p in combined)


def test_import_export_and_import_again_as_typed(work):
    pytest.importorskip("datasets")
    tmax(documented("tmax data import EXPORT_DIR -o data/tmax-15k --format harbor", EXPORT_DIR=str(DATA / "import" / "harbor")))
    assert Task.load(work / "data" / "tmax-15k" / "task_000001_ab12cd34").name
    for name in ("good", "no-solution", "nop-passes"):
        shutil.copytree(DATA / "validate" / name, work / "data" / "all" / name)
    tmax(documented("tmax data export data/all -o data/all.hf --format hf"))
    again = tmax(documented("tmax data import hf:data/all.hf -o data/all-again"))
    assert sorted(p.name for p in (work / "data" / "all-again").iterdir()) == ["good", "no-solution", "nop-passes"]
    assert "Traceback" not in again.output
