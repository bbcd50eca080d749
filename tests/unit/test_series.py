"""The series vocabulary (server.core.vocab) is the one the store, the trainer and the charts use."""

from __future__ import annotations

import pytest
from rollout_lens.server.core import vocab
from rollout_lens.server.store.models import StepRow
from rollout_lens.server.webapp.pages import plotly_figures
from rollout_lens.trainer.recorder import positional


def test_every_step_series_is_a_column_of_the_steps_table() -> None:
    columns = set(StepRow.__table__.columns.keys())
    assert set(vocab.STEP_SERIES) <= columns
    assert len(set(vocab.STEP_SERIES)) == len(vocab.STEP_SERIES)


def test_the_trainer_computes_every_probe_the_vocabulary_names() -> None:
    tokens = ["<tool>", "tool_01", "</tool>", "</assistant>"]
    probs = {t: [0.5] * len(tokens) for t in ("<tool>", "</tool>", "</assistant>")}
    row = positional.control_probes(
        tokens, probs, open_tag="<tool>", close_tag="</tool>", eot="</assistant>"
    )
    row |= positional.id_probes(
        {"tool_01": -0.1, "tool_02": -3.0}, ["tool_01", "tool_02"], "tool_01"
    )
    turns = [
        {"role": "model", "start": 0, "end": 2},
        {"role": "tool", "start": 2, "end": 3},
        {"role": "model", "start": 3, "end": 4},
    ]
    by_turn = positional.turn_probes(
        tokens, probs, turns, open_tag="<tool>", close_tag="</tool>", eot="</assistant>"
    )
    row |= {k: v for k, v in by_turn.items() if k not in row}  # the two after a tool result
    assert set(row) == set(vocab.POSITIONAL_PROBES) | set(vocab.ID_PROBES)
    out = positional.aggregate([row], [True], [False])
    for probe in row:
        for stat in vocab.PROBE_STATS:
            assert vocab.probe(probe, stat) in out


def test_every_probe_part_is_drawn() -> None:
    names = {
        vocab.probe(p, part)
        for p in (*vocab.POSITIONAL_PROBES, *vocab.ID_PROBES)
        for part in (*vocab.PROBE_STATS, *(f"{s}/mean" for s in vocab.PROBE_SPLITS))
    }
    drawn = {t["meta"]["series"] for f in plotly_figures.probe_details(names) for t in f["data"]}
    assert drawn == names


def test_labels_carry_their_units() -> None:
    assert vocab.label("vote_entropy") == "vote entropy (bits)"
    assert vocab.label("wall_time") == "step wall time (s)"
    assert vocab.label("trl/clip_ratio") == "trl/clip_ratio"  # unknown series: its name


def test_positional_probes_read_each_control_token_where_it_belongs_and_where_it_does_not() -> None:
    tokens = ["<tool>", "tool_01", "</tool>", "</assistant>"]
    # each token's probability at position i is (i + 1) / 10 + its own offset
    offset = {"<tool>": 0.0, "</tool>": 0.01, "</assistant>": 0.02}
    probs = {t: [(i + 1) / 10 + d for i in range(len(tokens))] for t, d in offset.items()}
    row = positional.control_probes(
        tokens, probs, open_tag="<tool>", close_tag="</tool>", eot="</assistant>"
    )
    assert row == pytest.approx(
        {
            "open_first": 0.1,  # <tool> at 0
            "eot_after_open": 0.22,  # </assistant> at 1
            "close_after_open": 0.21,  # </tool> at 1
            "close_after_id": 0.31,  # </tool> at 2
            "eot_after_id": 0.32,  # </assistant> at 2
            "eot_after_close": 0.42,  # </assistant> at 3
            "close_after_close": 0.41,  # </tool> at 3
        }
    )
    bare = positional.control_probes(
        ["<tool>"], probs, open_tag="<tool>", close_tag="</tool>", eot="</assistant>"
    )
    assert {k for k, v in bare.items() if v is not None} == {"open_first"}
    assert set(vocab.BELONGS) | set(vocab.MISPLACED) | set(vocab.NEUTRAL_PROBES) == set(
        vocab.POSITIONAL_PROBES
    )
    assert not set(vocab.BELONGS) & set(vocab.MISPLACED)
