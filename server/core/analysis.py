"""Pure summaries of a run's series: 25-step buckets, convergence step, stability."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rollout_lens.server.core.vocab import WINDOW

CONVERGED = 0.9  # the mean true accuracy of a WINDOW-step bucket that counts as converged


def buckets(
    steps: Sequence[int], values: Sequence[float | None], size: int = WINDOW
) -> list[tuple[int, float]]:
    """Mean of each `size`-step bucket, keyed by the bucket's first step (1–25 → 1, 26–50 → 26…)."""
    sums: dict[int, list[float]] = {}
    for step, value in zip(steps, values, strict=True):
        if value is not None:
            sums.setdefault((step - 1) // size * size + 1, []).append(value)
    return [(start, sum(vals) / len(vals)) for start, vals in sorted(sums.items())]


def rolling_mean(values: Sequence[float | None], window: int = WINDOW) -> list[float | None]:
    """Mean of the last `window` non-missing values at each position (None until one exists)."""
    out: list[float | None] = []
    recent: list[float] = []
    for value in values:
        if value is not None:
            recent.append(value)
            if len(recent) > window:
                recent.pop(0)
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def final_mean(values: Sequence[float | None], window: int = WINDOW) -> float | None:
    """Mean of the last `window` recorded values."""
    present = [v for v in values if v is not None][-window:]
    return statistics.fmean(present) if present else None


def bucket_ends(
    steps: Sequence[int], values: Sequence[float | None], size: int = WINDOW
) -> tuple[list[int], list[float | None]]:
    """The `size`-step buckets of per-step values as (end steps, means): the shape compare
    reads from the rollups, for what has the steps themselves (a benchmark)."""
    rows = buckets(steps, values, size)
    return [start + size - 1 for start, _ in rows], [mean for _, mean in rows]


def converged_at(
    ends: Sequence[int], accuracy: Sequence[float | None], last_step: int | None
) -> int | None:
    """When a run converged, the one definition (compare's summary, the benchmarks): the end
    step of the first closed `WINDOW`-step bucket (a step at or after its end recorded: it can
    change no more) whose mean true accuracy reaches `CONVERGED`. None if no bucket does."""
    if last_step is None:
        return None
    for end, value in zip(ends, accuracy, strict=True):
        if end <= last_step and value is not None and value >= CONVERGED:
            return end
    return None


def bucket_spread(
    ends: Sequence[int], values: Sequence[float | None], after: int | None
) -> float | None:
    """Spread (max − min) of the bucket means of the buckets ending at or after step `after`."""
    if after is None:
        return None
    tail = [v for end, v in zip(ends, values, strict=True) if end >= after and v is not None]
    return max(tail) - min(tail) if tail else None
