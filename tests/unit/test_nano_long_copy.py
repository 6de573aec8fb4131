"""benchmarks/nano_long_copy.py: the teacher-forced per-turn measure on real oracle episodes
(played through the harness in the local sandbox) and a real nano model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("nano_long_copy", REPO / "benchmarks" / "nano_long_copy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_random_model_gets_no_turn_right_and_every_turn_is_counted(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tmax.training.nano.model import build_nano_model
    from tmax.common.records import NanoMeta
    from tmax.training.nano.tasks import write_splits

    build_nano_model(tmp_path / "model", seed=0, family="long")
    splits = write_splits(tmp_path / "tasks", 4, 4, seed=0, family="long")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    dirs = [str(d) for d in splits["heldout"]]
    report = _bench().split_report(model, tok, dirs)
    assert report["episodes"] == 4 and report["episodes_every_turn_right"] == 0
    # One entry per turn: the commands the task needs, then the submit.
    longest = max(NanoMeta.read(d).depth for d in dirs) + 1
    assert sorted(map(int, report["turn_right"])) == list(range(longest))
    assert all(v.startswith("0/") for v in report["turn_right"].values())
    assert sum(int(v.split("/")[1]) for v in report["kind_every_turn_right"].values()) == 4
