"""Rated `tmax run --tokens` sessions on disk, as the run directory holds them (tokens.json,
run.json, reward.json), for the tests of `tmax learn --from-runs`."""

from __future__ import annotations

import json
from pathlib import Path

from tmax.agents.policy import TokenTrace, Usage
from tmax.agents.rating import write_reward
from tmax.common.records import RatingSource
from tmax.agents.recorder import Recorder


def write_session(root: Path, name: str, reward: float | None, *, sampled: int = 3, trace: TokenTrace | None = None,
                  model_dir: str = "/models/x", segments: tuple[TokenTrace, ...] = ()) -> Path:
    """The run directory `root/name`: `trace` (by default `sampled` sampled tokens and an
    unsampled one) served from `model_dir`, rated `reward` by the user (None: unrated);
    `segments`: the token segments of the contexts compactions closed before it."""
    d = root / name
    for n, segment in enumerate(segments, 1):
        Recorder(d).close_segment(n, [{"role": "system", "content": "s"}], segment)
    if trace is None:
        trace = TokenTrace(prompt_ids=[1, 2], ids=[5] * sampled + [7], logprobs=[-0.5] * sampled + [0.0],
                           mask=[1] * sampled + [0], turn_versions=[0])
    Recorder(d).save([{"role": "system", "content": "s"}], [], Usage(), 4, trace=trace)
    (d / "run.json").write_text(json.dumps({"model_dir": model_dir}))
    if reward is not None:
        write_reward(d, reward, RatingSource.USER)
    return d


def sampled_by(learner, prompt_ids: list[int], ids: list[int], mask: list[int]) -> TokenTrace:
    """A one-turn trace whose sampled tokens carry `learner`'s own logprobs, as vLLM serving
    the same weights records them (`training.learner.learner.Learner`)."""
    from tmax.training.learner.packing import TrainSample

    own = learner.logprobs([TrainSample(TokenTrace(prompt_ids, ids, [0.0] * len(ids), mask), 0.0)])[0]
    return TokenTrace(prompt_ids=prompt_ids, ids=ids, logprobs=[lp if m else 0.0 for lp, m in zip(own, mask)],
                      mask=mask, turn_versions=[0])
