"""The recorder's step summary (trainer/recorder/summary.py) against brute force: each control
token's mean and max over the positions the model sampled (tool results left out)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from rollout_lens.server.core import vocab
from rollout_lens.server.core.records import ControlProbs
from rollout_lens.trainer.recorder import summary

from tests.factories import make_multiturn_group, make_rollouts


def _brute(rollouts, token: str) -> list[float]:  # type: ignore[no-untyped-def]
    """Every probability of `token` at a position of a model turn (all of them without turns)."""
    out = []
    for r in rollouts:
        column = list(r.control_probs.get(token, []))
        turns = r.meta.get("turns")
        for i, p in enumerate(column):
            if turns is None or any(
                t["role"] == "model" and t["start"] <= i < t["end"] for t in turns
            ):
                out.append(p)
    return out


@pytest.mark.parametrize("multiturn", [False, True])
def test_control_token_figures_are_over_the_models_positions(multiturn: bool) -> None:
    rollouts = (
        make_multiturn_group() if multiturn else make_rollouts(random.Random(3), group_size=4)
    )
    rng = np.random.default_rng(7)
    tokens = ["<tool>", "</assistant>", "absent"]
    for r in rollouts:  # probabilities at every position, different at each
        r.control_probs = ControlProbs(tokens[:2], rng.random((len(r.completion_ids), 2)))
    _, series = summary.summarize(rollouts, len(rollouts), tokens)
    for token in tokens[:2]:
        found = _brute(rollouts, token)
        assert len(found) > 0
        assert series[vocab.ctrl(token, "mean")] == pytest.approx(sum(found) / len(found))
        assert series[vocab.ctrl(token, "max")] == max(found)
    if multiturn:  # the tool results' positions are left out
        every = sum(len(r.completion_ids) for r in rollouts)
        assert len(_brute(rollouts, tokens[0])) < every
    assert series[vocab.ctrl("absent", "mean")] is None
    assert series[vocab.ctrl("absent", "max")] is None
