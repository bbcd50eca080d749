"""float64 values as little-endian bytes: a step's generic series (layout) and a rollup's
aggregates (rollups). NaN payloads are kept bit for bit (layout tells "not logged" from
"logged without a finite value" by them)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_BIG_ENDIAN = sys.byteorder == "big"


def pack_doubles(values: Iterable[float]) -> bytes:
    """float64 values → bytes."""
    packed = array("d", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack_doubles(data: bytes | None) -> list[float]:
    """bytes → the float64 values."""
    values = array("d")
    if data:
        values.frombytes(data)
        if _BIG_ENDIAN:
            values.byteswap()
    return values.tolist()
