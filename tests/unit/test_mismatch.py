"""The mismatch figures against brute force: plain Python loops over the same tokens, for any
trainer and generator logprobs hypothesis draws (NaN and None where the generator gave none,
tool-result positions masked)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core import mismatch_drill as drill

LOGPROB = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)
# The generator's side: a logprob, or one it did not give (vLLM's None, NaN in TRL's tensor).
GENERATED = st.one_of(LOGPROB, LOGPROB, LOGPROB, st.just(math.nan), st.none())


@st.composite
def rollout(draw: Any) -> tuple[list[float], list[float | None] | None, list[bool] | None]:
    n = draw(st.integers(min_value=0, max_value=12))
    trainer = draw(st.lists(LOGPROB, min_size=n, max_size=n))
    generator = draw(st.one_of(st.none(), st.lists(GENERATED, min_size=n, max_size=n)))
    mask = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    return trainer, generator, mask


def _sides(raw: tuple[Any, Any, Any]) -> mm.Sides:
    trainer, generator, mask = raw
    return mm.Sides(np.asarray(trainer, dtype=np.float64), generator, mask and np.asarray(mask))


def _brute_pairs(raw: tuple[Any, Any, Any]) -> list[tuple[int, float]]:
    """(position, log r) of each compared token, by hand."""
    trainer, generator, mask = raw
    if generator is None:
        return []
    out = []
    for i, (t, g) in enumerate(zip(trainer, generator, strict=True)):
        if (mask is None or mask[i]) and g is not None and not math.isnan(g):
            out.append((i, t - g))
    return out


def _brute_step(rollouts: list[tuple[Any, Any, Any]]) -> dict[str, float]:
    tokens: list[float] = []
    ratios: list[float] = []
    for raw in rollouts:
        pairs = [r for _, r in _brute_pairs(raw)]
        tokens += pairs
        if pairs:
            ratios.append(math.exp(math.fsum(pairs)))
    if not tokens:
        return {}
    k3 = [math.exp(x) - 1 - x for x in tokens]
    return {
        mm.ABS_DIFF_MEAN: sum(abs(x) for x in tokens) / len(tokens),
        mm.ABS_DIFF_MAX: max(abs(x) for x in tokens),
        mm.K3_KL: sum(k3) / len(k3),
        mm.SEQ_RATIO_MIN: min(ratios),
        mm.SEQ_RATIO_MEAN: sum(ratios) / len(ratios),
        mm.SEQ_RATIO_MAX: max(ratios),
        mm.OUTSIDE_2X: sum(not (0.5 <= math.exp(x) <= 2) for x in tokens) / len(tokens),
        mm.OUTSIDE_5X: sum(not (0.2 <= math.exp(x) <= 5) for x in tokens) / len(tokens),
    }


@settings(max_examples=300, deadline=None)
@given(st.lists(rollout(), max_size=6))
def test_step_figures_equal_brute_force(rollouts: list[tuple[Any, Any, Any]]) -> None:
    got = mm.step_figures([_sides(r) for r in rollouts])
    want = _brute_step(rollouts)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


@settings(max_examples=300, deadline=None)
@given(rollout())
def test_rollout_figures_equal_brute_force(raw: tuple[Any, Any, Any]) -> None:
    got = mm.rollout_figures(_sides(raw))
    pairs = [r for _, r in _brute_pairs(raw)]
    if not pairs:
        assert got is None  # nothing compared: no figure, never a 0 that reads as agreement
        return
    assert got is not None
    assert got.tokens == len(pairs)
    assert got.abs_diff_max == max(abs(x) for x in pairs)
    assert got.seq_ratio == pytest.approx(math.exp(math.fsum(pairs)), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(rollout(), max_size=6))
def test_drill_down_equals_brute_force(rollouts: list[tuple[Any, Any, Any]]) -> None:
    sides = [_sides(r) for r in rollouts]
    found = [(k, i, r) for k, raw in enumerate(rollouts) for i, r in _brute_pairs(raw)]
    log_r = [r for _, _, r in found]
    hist = drill.histogram(mm.pooled(sides))
    inside = [x for x in log_r if -3.0 <= x <= 3.0]
    assert int(hist.counts.sum()) == len(inside)
    assert (hist.below, hist.above) == (sum(x < -3 for x in log_r), sum(x > 3 for x in log_r))
    for edge in hist.bands:  # the band edges are bin edges: no bin straddles a band
        assert np.any(np.isclose(hist.edges, edge, rtol=0, atol=1e-15))
    for left, right, count in zip(hist.edges[:-1], hist.edges[1:], hist.counts, strict=True):
        last = right == hist.edges[-1]
        assert count == sum(left <= x < right or (last and x == right) for x in inside)
    worst = drill.worst_tokens(sides, n=5)
    want = sorted(found, key=lambda f: (-abs(f[2]), f[0], f[1]))[:5]
    assert [(w.rollout, w.position, w.log_ratio) for w in worst] == want


@settings(max_examples=200, deadline=None)
@given(st.lists(rollout(), max_size=6))
def test_by_probability_equals_brute_force(rollouts: list[tuple[Any, Any, Any]]) -> None:
    rows = drill.by_probability([_sides(r) for r in rollouts])
    edges = drill.PROBABILITY_EDGES
    assert [(b.low, b.high) for b in rows] == list(zip(edges[:-1], edges[1:], strict=True))
    members: list[list[float]] = [[] for _ in rows]
    for raw in rollouts:
        generator = raw[1]
        for i, r in _brute_pairs(raw):
            p = math.exp(generator[i])
            k = next(k for k in range(len(rows)) if p < edges[k + 1] or k == len(rows) - 1)
            members[k].append(r)
    for bucket, log_r in zip(rows, members, strict=True):
        assert bucket.tokens == len(log_r)
        if not log_r:
            assert bucket.abs_diff_mean is None and bucket.k3_kl is None
            continue
        assert bucket.abs_diff_max == max(abs(x) for x in log_r)
        assert bucket.abs_diff_mean == pytest.approx(sum(abs(x) for x in log_r) / len(log_r))
        assert bucket.k3_kl == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / len(log_r))


def test_identical_sides_have_no_mismatch() -> None:
    """The same logprobs on both sides: every figure says so exactly (what staleness 0 in
    float32 must show)."""
    logps = np.log(np.array([0.9, 0.5, 0.01, 0.3]))
    figures = mm.step_figures([mm.Sides(logps, logps.copy()), mm.Sides(logps[:2], logps[:2])])
    assert figures[mm.ABS_DIFF_MAX] == 0 and figures[mm.K3_KL] == 0
    assert figures[mm.SEQ_RATIO_MIN] == figures[mm.SEQ_RATIO_MAX] == 1
    assert figures[mm.OUTSIDE_2X] == figures[mm.OUTSIDE_5X] == 0


def test_no_generator_side_is_no_figure() -> None:
    """A path without generator logprobs gives no figures at all (absent, not zeros)."""
    logps = np.log(np.array([0.9, 0.5]))
    assert mm.step_figures([mm.Sides(logps, None), mm.Sides(logps, [None, math.nan])]) == {}
    assert mm.rollout_figures(mm.Sides(logps, None)) is None


@pytest.mark.parametrize(
    ("generator", "mask", "message"),
    [
        ([-0.1], None, "generator logprobs have 1 positions, trainer logprobs 2"),
        ([-0.1, -0.2], [True], "the mask has 1 positions, the logprobs 2"),
    ],
)
def test_lengths_must_agree(generator: list[float], mask: list[bool] | None, message: str) -> None:
    sides = mm.Sides(np.array([-0.1, -0.2]), generator, mask and np.asarray(mask))
    with pytest.raises(ValueError, match=message):
        mm.step_figures([sides])


def test_band_edge_is_inside() -> None:
    """A ratio of exactly 2 (or 1/2) lies inside [1/2, 2]: TIS and MIS keep it."""
    trainer = np.array([math.log(0.5), math.log(0.25), math.log(0.9)])
    generator = np.array([math.log(0.25), math.log(0.5), math.log(0.9 / 2.5)])
    figures = mm.step_figures([mm.Sides(trainer, generator)])
    assert figures[mm.OUTSIDE_2X] == pytest.approx(1 / 3)
    assert figures[mm.OUTSIDE_5X] == 0


def test_histogram_needs_room_for_the_bands() -> None:
    with pytest.raises(ValueError, match="limit > log 5"):
        drill.histogram(np.zeros(3), limit=1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(rollout(), max_size=6), st.integers(min_value=0, max_value=30))
def test_a_sample_is_bounded_holds_the_worst_and_is_the_same_every_time(
    rollouts: list[tuple[Any, Any, Any]], most: int
) -> None:
    tokens = mm.pool([_sides(r) for r in rollouts])
    worst = drill.worst_of(tokens, min(5, most))
    shown = drill.sample(tokens, most, worst)
    n = len(tokens.trainer)
    assert len(shown) == min(n, max(most, len(worst)))
    assert set(worst.tolist()) <= set(shown.tolist())
    assert shown.tolist() == sorted(set(shown.tolist())) and all(0 <= i < n for i in shown)
    assert drill.sample(tokens, most, worst).tolist() == shown.tolist()


def test_a_pool_lays_the_compared_tokens_end_to_end() -> None:
    sides = [
        mm.Sides(np.array([-1.0, -2.0, -3.0]), [-1.5, None, -2.0]),
        mm.Sides(np.array([-0.5]), None),
        mm.Sides(np.array([-0.1, -0.2]), [-0.1, -0.4], np.array([False, True])),
    ]
    tokens = mm.pool(sides)
    assert tokens.rollout.tolist() == [0, 0, 2] and tokens.position.tolist() == [0, 2, 1]
    assert tokens.log_ratios().tolist() == pytest.approx([0.5, -1.0, 0.2])
