"""The distinct values of an integer array, by a sort (and, for token ids, a table), not by
`np.unique`.

NumPy 2.4's `np.unique(values)` (no `return_*`) finds the distinct values by hashing, which is
slower than sorting on this project's wider values: on a quiet machine, medians of 5, 560,000
64-bit keys (a search row's number and its row, server.store.search) took 198 ms against 42
for a sort and a mask of where each run of equal values starts; a step's 525,000 token ids
of a 150,000-id vocabulary 80 against 39 drawn uniformly, 26 against 25 drawn as Zipf's law
draws them. With `return_inverse` it sorts (19-25 ms), where a table of every id (ids are
below a vocabulary's size) gives the same in 3.
"""

from __future__ import annotations

import numpy as np

TABLE_IDS = 1 << 22  # ids below this are found with a table of every id (4 MB of booleans)


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D integer array, sorted (`np.unique(values)`)."""
    ordered = np.sort(values, kind="stable")
    if not len(ordered):
        return ordered
    starts = np.empty(len(ordered), dtype=bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    return ordered[starts]


def distinct_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D integer array, sorted, and where each value is among them
    (`np.unique(values, return_inverse=True)`): non-negative values below TABLE_IDS through a
    table of them, others by a sort."""
    values = np.asarray(values)
    largest = int(values.max()) if len(values) else -1
    if len(values) and values.min() >= 0 and largest < TABLE_IDS:
        present = np.zeros(largest + 1, dtype=bool)
        present[values] = True
        found = np.flatnonzero(present).astype(values.dtype, copy=False)
        place = np.cumsum(present, dtype=np.int64) - 1
        return found, place[values]
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.ones(len(ordered), dtype=bool)
    if len(ordered):
        np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[order] = np.cumsum(starts) - 1
    return ordered[starts], inverse
