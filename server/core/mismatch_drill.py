"""A step's (or a range of steps') mismatch drilled down: the histogram of token log-ratios with
the TIS/MIS bands, the table by the sampled token's probability, and the worst tokens (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from rollout_lens.server.core.mismatch import BANDS, Pool, Sides, k3, outside, pool

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
    return probability_table(pool(rollouts), edges)


def probability_table(tokens: Pool, edges: Sequence[float] = PROBABILITY_EDGES) -> list[Bucket]:
    """by_probability over tokens already pooled: each figure summed by bucket in one pass."""
    buckets = len(edges) - 1
    probs = np.exp(tokens.generator)
    log_r = tokens.log_ratios()
    which = np.zeros(len(probs), dtype=np.int64)  # the bucket: interior edges at or below p
    for edge in edges[1:-1]:
        which += probs >= edge
    diff = np.abs(log_r)
    n = np.bincount(which, minlength=buckets)
    diff_sum, k3_sum, out2_sum, out5_sum = (
        np.bincount(which, weights.astype(np.float64), minlength=buckets).tolist()
        for weights in (diff, k3(log_r), outside(log_r, BANDS[0]), outside(log_r, BANDS[1]))
    )
    top = np.full(buckets, -np.inf)
    np.maximum.at(top, which, diff)
    rows = []
    for i in range(buckets):
        count = int(n[i])
        if not count:
            rows.append(Bucket(edges[i], edges[i + 1], 0, None, None, None, None, None))
            continue
        rows.append(
            Bucket(
                edges[i],
                edges[i + 1],
                count,
                abs_diff_mean=diff_sum[i] / count,
                abs_diff_max=float(top[i]),
                k3_kl=k3_sum[i] / count,
                outside_2x=out2_sum[i] / count,
                outside_5x=out5_sum[i] / count,
            )
        )
    return rows


@dataclass(frozen=True)
class WorstToken:
    rollout: int  # the index into the rollouts given
    position: int  # the completion position
    log_ratio: float


def worst_tokens(rollouts: Sequence[Sides], n: int = 10) -> list[WorstToken]:
    """The `n` compared tokens of largest |log r|, largest first (ties: earliest first), for
    the drill-down's links to the rollouts that hold them."""
    tokens = pool(rollouts)
    return [
        WorstToken(int(tokens.rollout[i]), int(tokens.position[i]), float(tokens.log_ratios()[i]))
        for i in worst_of(tokens, n)
    ]


def worst_of(tokens: Pool, n: int) -> np.ndarray:
    """Indices into `tokens` of the `n` largest |log r|, largest first (ties: earliest rollout,
    then position): one partition and a sort of the candidates, never a sort of every token."""
    size = np.abs(tokens.log_ratios())
    if n <= 0 or not len(size):
        return np.zeros(0, dtype=np.int64)
    chosen = np.arange(len(size))
    if len(size) > n:
        cut = np.partition(size, len(size) - n)[len(size) - n]  # the n-th largest
        chosen = np.flatnonzero(size >= cut)
    order = np.lexsort((tokens.position[chosen], tokens.rollout[chosen], -size[chosen]))
    picked: np.ndarray = chosen[order][:n]
    return picked


def sample(tokens: Pool, most: int, keep: np.ndarray) -> np.ndarray:
    """Indices into `tokens` of at most `most` of them (and every one of `keep`), ascending, for
    a scatter: `keep` (the worst tokens) and the first of a fixed-seed draw without replacement
    that are not in it, so that the same tokens give the same points on every read."""
    n = len(tokens.trainer)
    if n <= most:
        return np.arange(n)
    kept = np.unique(keep)
    drawn = np.random.default_rng(0).choice(n, size=most, replace=False)
    rest = drawn[~np.isin(drawn, kept)][: max(0, most - len(kept))]
    both: np.ndarray = np.union1d(kept, rest)
    return both
