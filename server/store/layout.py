"""How a step's series are laid out: the STEP_SERIES columns, then the run's generic series
packed in `StepRow.series` in the order of `RunRow.series_names`.

A value is a float64; a name not logged at the step is a quiet NaN; a name logged without a
finite value (None, NaN, ±inf: nothing a chart can draw) is a NaN with payload 1, so an export
still says it was logged."""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store.models import StepRow
from rollout_lens.server.store.packing import pack_doubles, unpack_doubles

STEP_COLUMNS = tuple(getattr(StepRow, name) for name in STEP_SERIES)
_NONE_BITS = 0x7FF8_0000_0000_0001
LOGGED_NONE: float = struct.unpack("<d", struct.pack("<Q", _NONE_BITS))[0]
_NOT_LOGGED_BITS = struct.unpack("<Q", struct.pack("<d", math.nan))[0]  # encode's quiet NaN


def all_names(series_names: Sequence[str]) -> list[str]:
    """Every series of a run in layout order: the step columns, then its generic series."""
    return [*STEP_SERIES, *series_names]


def encode(values: Mapping[str, float | None], series_names: Sequence[str]) -> bytes | None:
    """A step's generic series → packed float64 in `series_names` order (None if none logged)."""
    if not values:
        return None
    out = [math.nan] * len(series_names)
    for i, name in enumerate(series_names):
        if name in values:
            value = values[name]
            out[i] = value if value is not None and math.isfinite(value) else LOGGED_NONE
    return pack_doubles(out)


def decode(data: bytes | None, n_names: int) -> list[float | None]:
    """Packed generic series → n_names values (None where not logged)."""
    values: list[float | None] = [None if v != v else v for v in unpack_doubles(data)]
    return (values + [None] * n_names)[:n_names]


def names_logged(data: bytes | None) -> int:
    """How many of the run's names a step's packed series reach: 1 + the place of the last name
    logged at the step (0 when none)."""
    if not data:
        return 0
    bits = np.frombuffer(data, dtype="<u8")
    logged = np.flatnonzero(bits != _NOT_LOGGED_BITS)
    return int(logged[-1]) + 1 if logged.size else 0


def row_values(row: Sequence[Any], n_series: int) -> list[float | None]:
    """A (step, *STEP_SERIES columns, series) row → values in all_names order."""
    columns = list(row[1 : 1 + len(STEP_SERIES)])
    return columns + decode(row[1 + len(STEP_SERIES)], n_series)


def named(data: bytes | None, series_names: Sequence[str]) -> dict[str, float | None]:
    """Packed generic series → name → value (None: logged without a finite value), for the
    names logged at the step."""
    if not data:
        return {}
    bits = array("Q", data)
    if sys.byteorder == "big":
        bits.byteswap()
    out: dict[str, float | None] = {}
    for name, value, raw in zip(series_names, unpack_doubles(data), bits, strict=False):
        if value == value:
            out[name] = value
        elif raw == _NONE_BITS:
            out[name] = None
    return out
