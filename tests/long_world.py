"""The long-horizon nano world for tests: its tokenizer and task splits, built locally."""

from __future__ import annotations

from pathlib import Path


def long_world(root: Path, n_train: int, n_heldout: int):
    """(the long family's tokenizer, the splits `write_splits` wrote under `root`), seed 0."""
    from transformers import AutoTokenizer

    from tmax.training.nano.model import build_tokenizer
    from tmax.training.nano.tasks import write_splits

    build_tokenizer(0, family="long").save_pretrained(root / "tok")
    splits = write_splits(root / "tasks", n_train, n_heldout, seed=0, family="long")
    return AutoTokenizer.from_pretrained(root / "tok"), splits
