"""server.core.distinct against np.unique, its oracle: the same values, the same inverse."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_lens.server.core.distinct import TABLE_IDS, distinct, distinct_inverse

CASES = {
    "empty": np.zeros(0, dtype=np.int64),
    "one": np.array([7], dtype=np.int64),
    "token ids": np.random.default_rng(0).zipf(1.2, 50_000).astype(np.int64) % 150_000,
    "int32 ids": np.random.default_rng(1).integers(0, 49_152, 20_000).astype(np.int32),
    "negative": np.random.default_rng(2).integers(-5, 5, 1_000),
    "past the table": np.array([TABLE_IDS, 3, TABLE_IDS + 9, 3, 0], dtype=np.int64),
    "64-bit keys": (np.random.default_rng(3).integers(0, 512, 30_000) << 32)
    | np.random.default_rng(4).integers(0, 3_000_000, 30_000),
}


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_distinct_is_np_unique(values: np.ndarray) -> None:
    expected = np.unique(values)
    found = distinct(values)
    assert found.dtype == values.dtype and np.array_equal(found, expected)


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_distinct_inverse_is_np_unique_with_its_inverse(values: np.ndarray) -> None:
    expected, where = np.unique(values, return_inverse=True)
    found, inverse = distinct_inverse(values)
    assert found.dtype == values.dtype and np.array_equal(found, expected)
    assert np.array_equal(inverse, where) and np.array_equal(found[inverse], values)
