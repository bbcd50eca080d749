"""Compact little-endian packing of per-token arrays (bytes, not JSON lists of floats)."""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

_BIG_ENDIAN = sys.byteorder == "big"


def _to_bytes(values: array[Any]) -> bytes:
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


def _from_bytes(typecode: str, data: bytes | None) -> array[Any]:
    values = array(typecode)
    if data:
        values.frombytes(data)
        if _BIG_ENDIAN:
            values.byteswap()
    return values


def pack_floats(values: Iterable[float]) -> bytes:
    """float32 array → bytes."""
    return _to_bytes(array("f", values))


def unpack_floats(data: bytes | None) -> list[float]:
    """bytes → list of floats (float32 precision)."""
    return _from_bytes("f", data).tolist()


def pack_ints(values: Iterable[int]) -> bytes:
    """int32 array → bytes."""
    return _to_bytes(array("i", values))


def unpack_ints(data: bytes | None) -> list[int]:
    """bytes → list of ints."""
    return _from_bytes("i", data).tolist()


def pack_matrix(rows: Sequence[Sequence[float]]) -> bytes:
    """Equal-length float rows, row-major, → bytes."""
    width = len(rows[0]) if rows else 0
    if any(len(row) != width for row in rows):
        raise ValueError("pack_matrix needs rows of equal length")
    return pack_floats(x for row in rows for x in row)


def unpack_matrix(data: bytes | None, n_rows: int) -> list[list[float]]:
    """bytes → n_rows equal rows."""
    return _rows(unpack_floats(data), n_rows)


# Per-token arrays for display (logprobs, control-token probabilities) are stored as IEEE float16:
# 11 significant bits, ±65504, NaN and ±inf kept. A probability is off by at most 2.5e-4 near 1
# and reaches down to 6e-8; a logprob of -12.34 reads back as -12.34375 (a shade, a tooltip). Σ logprob, rewards
# and advantages are float64 columns, computed from full precision before packing.
_HALF_MAX = 65504.0


def _half(value: float) -> float:
    if value != value or value in (math.inf, -math.inf):  # NaN and infinities pack as they are
        return value
    return min(max(value, -_HALF_MAX), _HALF_MAX)


def pack_halves(values: Sequence[float]) -> bytes:
    """float16 array → bytes (finite values beyond ±65504 clip to it)."""
    try:
        return struct.pack(f"<{len(values)}e", *values)
    except OverflowError:  # rare: clip only then (the per-value check costs more than packing)
        return struct.pack(f"<{len(values)}e", *map(_half, values))


def unpack_halves(data: bytes | None) -> list[float]:
    """bytes → list of floats (float16 precision)."""
    if not data:
        return []
    return list(struct.unpack(f"<{len(data) // 2}e", data))


def pack_half_matrix(rows: Sequence[Sequence[float]]) -> bytes:
    """Equal-length rows, row-major, float16 → bytes."""
    width = len(rows[0]) if rows else 0
    if any(len(row) != width for row in rows):
        raise ValueError("pack_half_matrix needs rows of equal length")
    return pack_halves([x for row in rows for x in row])


def unpack_half_matrix(data: bytes | None, n_rows: int) -> list[list[float]]:
    """bytes → n_rows equal float16 rows."""
    return _rows(unpack_halves(data), n_rows)


def pack_doubles(values: Iterable[float]) -> bytes:
    """float64 array → bytes (a step's series, rollup aggregates)."""
    return _to_bytes(array("d", values))


def unpack_doubles(data: bytes | None) -> list[float]:
    """bytes → list of floats (float64)."""
    return _from_bytes("d", data).tolist()


def _rows(flat: list[float], n_rows: int) -> list[list[float]]:
    if n_rows == 0:
        return []
    if len(flat) % n_rows:
        raise ValueError(f"{len(flat)} values do not split into {n_rows} rows")
    width = len(flat) // n_rows
    return [flat[i * width : (i + 1) * width] for i in range(n_rows)]


# Heads of the arrays: a page showing part of a long completion decodes only that part.
INT_BYTES, HALF_BYTES = 4, 2


def count_ints(data: bytes | None) -> int:
    """How many int32 values `data` holds (a completion's token count)."""
    return len(data or b"") // INT_BYTES


def head_ints(data: bytes | None, n: int) -> list[int]:
    """The first n int32 values only."""
    return unpack_ints((data or b"")[: n * INT_BYTES])


def head_halves(data: bytes | None, n: int) -> list[float]:
    """The first n float16 values only."""
    return unpack_halves((data or b"")[: n * HALF_BYTES])


def head_half_matrix(data: bytes | None, n_rows: int, n: int) -> list[list[float]]:
    """The first n columns of each of n_rows equal float16 rows (see unpack_half_matrix)."""
    if n_rows == 0:
        return []
    values = len(data or b"") // HALF_BYTES
    if values % n_rows:
        raise ValueError(f"{values} values do not split into {n_rows} rows")
    row_bytes = values // n_rows * HALF_BYTES
    cut = min(n * HALF_BYTES, row_bytes)
    raw = data or b""
    return [unpack_halves(raw[i * row_bytes : i * row_bytes + cut]) for i in range(n_rows)]
