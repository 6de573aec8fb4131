"""The harness registry: one name per agent style, for `run`, `bench` and `learn`."""

from __future__ import annotations

from tmax.agents.harness import Harness, TmaxHarness
from tmax.agents.mini_swe import MiniSweHarness
from tmax.agents.terminus import TerminusHarness

HARNESSES = ("tmax", "mini-swe", "terminus-2")
DEFAULT_HARNESS = "tmax"


def check_harness(name: str, setting: str = "harness") -> str:
    """`name` if it is a harness; otherwise a ValueError naming the `setting` it came from."""
    if name not in HARNESSES:
        raise ValueError(f"unknown {setting} {name!r}: choose one of {', '.join(HARNESSES)}")
    return name


def make_harness(name: str, workdir: str | None = None) -> Harness:
    """A fresh harness (harnesses keep per-episode state). `workdir` is where mini-swe's
    one-off processes and the terminus tmux session start."""
    check_harness(name)
    if name == "tmax":
        return TmaxHarness()
    if name == "mini-swe":
        return MiniSweHarness(workdir)
    return TerminusHarness(workdir)
