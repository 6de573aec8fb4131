"""A `tmax data generate` corpus is training data: its tasks go through the same learn
path as any Harbor task (environments resolved up front, then `training.rollout.run_episode`
in a host sandbox, the task's own verifier scoring the episode), and an episode that does
what the task's reference solution does earns reward 1, one that does not earns 0."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmax.agents.prompts import SUBMIT_COMMAND
from tmax.cli.main import app
from tmax.training.config import preset
from tmax.training.rollout import EpisodeRequest, EpisodeSettings, prepare_tasks, run_episode
from tmax.training.demos import ScriptedSampler, scripted_turns

from data_scripted_generator import Responder  # noqa: E402
from scripted_server import ScriptedServer  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "generated"
    with ScriptedServer(Responder(["good", "good"])) as srv:
        r = CliRunner().invoke(app, ["data", "generate", "-o", str(out), "-N", "2", "--base-url", srv.base_url,
                                     "-m", srv.model, "--seed", "5", "-e", "bwrap", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer

    root = tmp_path_factory.mktemp("tok")
    build_tokenizer(0).save_pretrained(root)
    return AutoTokenizer.from_pretrained(root)


def _solution_command(task_dir: Path) -> str:
    lines = (task_dir / "solution" / "solve.sh").read_text().splitlines()
    return "\n".join(x for x in lines if x.strip() and not x.startswith("#!"))


def test_generated_tasks_train_through_the_rollout_path(corpus, tokenizer):
    cfg = preset("nano").rollout
    cfg.sandbox = "bwrap"
    tasks = sorted(str(d) for d in corpus.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))
    assert len(tasks) == 2
    episode = EpisodeSettings.of(cfg)
    prepared = prepare_tasks(episode.env, tasks)
    assert sorted(prepared.runnable) == tasks and not prepared.dropped

    for i, task in enumerate(tasks):
        solve = scripted_turns(tokenizer, [("Do what the task asks.", _solution_command(Path(task))),
                                           ("Done.", SUBMIT_COMMAND)])
        good = run_episode(EpisodeRequest(task, i, 0, 1), ScriptedSampler(solve), tokenizer, episode)
        assert good.status == "submitted" and good.sandbox == "bwrap"
        assert good.reward == 1.0, good.verifier
        idle = scripted_turns(tokenizer, [("Nothing to do.", "true"), ("Done.", SUBMIT_COMMAND)])
        bad = run_episode(EpisodeRequest(task, i, 1, 2), ScriptedSampler(idle), tokenizer, episode)
        assert bad.status == "submitted" and bad.reward == 0.0
