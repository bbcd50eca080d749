"""bench/mismatch.py on the tiny model, briefly, so that it keeps running and keeps its promise:
a generator that is the trainer (staleness 0, float32) shows no mismatch, TRL's figures and
core.mismatch's alike; one step stale it does, from the first step that has a stale copy."""

from __future__ import annotations

import re

import pytest

from bench import mismatch

pytestmark = pytest.mark.slow


def _rows(text: str) -> list[list[float]]:
    return [
        [float(x) for x in line.split()[1:]]
        for line in text.splitlines()
        if re.match(r"^ +\d+ ", line)
    ]


def test_staleness_makes_mismatch_and_none_makes_none(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    args = mismatch.parser().parse_args(["--model", "tiny", "--steps", "3", "--seed", "0"])
    mismatch.run(args, 0)
    fresh = _rows(capsys.readouterr().out)
    mismatch.run(args, 1)
    stale = _rows(capsys.readouterr().out)
    assert len(fresh) == len(stale) == 3
    columns = [h for h, _ in (*mismatch.TRL, *mismatch.OURS)]
    at = {name: columns.index(name) for name in ("|Δ| max", "k3 KL")}
    assert all(row[at["|Δ| max"]] < 1e-4 for row in fresh)  # float rounding only
    assert all(row[at["k3 KL"]] < 1e-8 for row in fresh)
    assert stale[0] == fresh[0]  # no older copy yet at the first step
    assert all(row[at["|Δ| max"]] > 1e-2 for row in stale[1:])
    for row in (*fresh, *stale):  # TRL's |Δ| mean and max are core.mismatch's
        assert row[0] == pytest.approx(row[5], rel=1e-3) and row[1] == pytest.approx(
            row[6], rel=1e-3
        )
