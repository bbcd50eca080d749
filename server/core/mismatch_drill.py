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
class Pool:
    """Every compared token of some rollouts laid end to end, in rollout and position order:
    the rollout holding it (an index into the rollouts given), its completion position, and
    both sides' logprobs."""

    rollout: np.ndarray  # int64
    position: np.ndarray  # int64
    trainer: np.ndarray
    generator: np.ndarray

    def log_ratios(self) -> np.ndarray:
        log_r: np.ndarray = self.trainer - self.generator
        return log_r


def pool(rollouts: Sequence[Sides]) -> Pool:
    """The compared tokens of `rollouts` (Sides.kept: masked, NaN on either side left out)."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for index, sides in enumerate(rollouts):
        keep = sides.kept()
        at = np.flatnonzero(keep)
        if len(at):
            trainer, generator = sides.trainer_floats()[keep], sides.generator_floats()[keep]
            parts.append((np.full(len(at), index, dtype=np.int64), at, trainer, generator))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Pool(empty, empty, np.zeros(0), np.zeros(0))
    rollout, position, trainer, generator = (np.concatenate(c) for c in zip(*parts, strict=True))
    return Pool(rollout, position.astype(np.int64), trainer, generator)


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
    """by_probability over tokens already pooled."""
    probs = np.exp(tokens.generator)
    log_r = tokens.log_ratios()
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
    """Indices into `tokens` of at most `most` of them, ascending, for a scatter: every index
    in `keep` (the worst tokens), the rest drawn without replacement with a fixed seed, so that
    the same tokens give the same points on every read."""
    n = len(tokens.trainer)
    if n <= most:
        return np.arange(n)
    kept = np.unique(keep)
    rest = np.setdiff1d(np.arange(n), kept, assume_unique=True)
    drawn = np.random.default_rng(0).choice(rest, size=max(0, most - len(kept)), replace=False)
    both: np.ndarray = np.union1d(kept, drawn)
    return both
