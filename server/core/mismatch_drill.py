"""A step's (or a range of steps') mismatch drilled down: the histogram of token log-ratios with
the TIS/MIS bands, the table by the sampled token's probability, and the worst tokens (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from rollout_lens.server.core.mismatch import BANDS, Sides, k3, outside

# log r of the bands' edges, ascending: −log 5, −log 2, log 2, log 5
BAND_EDGES = tuple(sorted(s * math.log(b) for b in BANDS for s in (-1.0, 1.0)))
# The sampled token's probability under the generator, by decade where mismatch lives (low
# probabilities) and coarser near 1. Each bucket is [low, high); the last holds 1.0 too.
PROBABILITY_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


@dataclass(frozen=True)
class Histogram:
    """Counts of log r between `edges` (ascending; the band edges are among them), and the
    tokens beyond either end."""

    edges: np.ndarray
    counts: np.ndarray  # int64, len(edges) − 1
    below: int
    above: int
    bands: tuple[float, ...] = BAND_EDGES


def histogram(log_ratios: np.ndarray, limit: float = 3.0, bins: int = 60) -> Histogram:
    """log r binned evenly over [−limit, limit], the band edges added as edges (so no bin
    straddles a band); a bin holds [left, right), the last one its right edge too."""
    if limit <= BAND_EDGES[-1] or bins < 1:
        raise ValueError(f"a histogram needs limit > log {BANDS[-1]:g} and bins ≥ 1")
    values = np.asarray(log_ratios, dtype=np.float64).reshape(-1)
    edges = np.union1d(np.linspace(-limit, limit, bins + 1), BAND_EDGES)
    counts, _ = np.histogram(values, bins=edges)
    return Histogram(
        edges=edges,
        counts=counts.astype(np.int64),
        below=int(np.count_nonzero(values < -limit)),
        above=int(np.count_nonzero(values > limit)),
    )


@dataclass(frozen=True)
class Bucket:
    """The compared tokens whose generator probability lies in [low, high)."""

    low: float
    high: float
    tokens: int
    abs_diff_mean: float | None  # None: no token in the bucket
    abs_diff_max: float | None
    k3_kl: float | None
    outside_2x: float | None
    outside_5x: float | None


def by_probability(
    rollouts: Sequence[Sides], edges: Sequence[float] = PROBABILITY_EDGES
) -> list[Bucket]:
    """Mismatch by the sampled token's probability under the generator, one row a bucket."""
    pairs = [s.compared() for s in rollouts]
    generator = [g for _, g in pairs]
    ratios = [t - g for t, g in pairs]
    probs = np.exp(np.concatenate(generator)) if generator else np.zeros(0)
    log_r = np.concatenate(ratios) if ratios else np.zeros(0)
    which = np.clip(np.searchsorted(edges, probs, side="right") - 1, 0, len(edges) - 2)
    return [_bucket(edges[i], edges[i + 1], log_r[which == i]) for i in range(len(edges) - 1)]


def _bucket(low: float, high: float, log_r: np.ndarray) -> Bucket:
    if not len(log_r):
        return Bucket(low, high, 0, None, None, None, None, None)
    diff = np.abs(log_r)
    return Bucket(
        low,
        high,
        len(log_r),
        float(np.mean(diff)),
        float(np.max(diff)),
        float(np.mean(k3(log_r))),
        float(np.mean(outside(log_r, BANDS[0]))),
        float(np.mean(outside(log_r, BANDS[1]))),
    )


@dataclass(frozen=True)
class WorstToken:
    rollout: int  # the index into the rollouts given
    position: int  # the completion position
    log_ratio: float


def worst_tokens(rollouts: Sequence[Sides], n: int = 10) -> list[WorstToken]:
    """The `n` compared tokens of largest |log r|, largest first (ties: earliest first), for
    the drill-down's links to the rollouts that hold them."""
    found: list[WorstToken] = []
    for index, sides in enumerate(rollouts):
        positions = np.flatnonzero(sides.kept())
        found += [
            WorstToken(index, int(p), float(r))
            for p, r in zip(positions, sides.log_ratios(), strict=True)
        ]
    found.sort(key=lambda t: (-abs(t.log_ratio), t.rollout, t.position))
    return found[:n]
