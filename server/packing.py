"""Compact little-endian packing of per-token arrays (bytes, not JSON lists of floats)."""

from __future__ import annotations

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
    flat = unpack_floats(data)
    if n_rows == 0:
        return []
    if len(flat) % n_rows:
        raise ValueError(f"{len(flat)} values do not split into {n_rows} rows")
    width = len(flat) // n_rows
    return [flat[i * width : (i + 1) * width] for i in range(n_rows)]


ITEM_BYTES = 4  # int32 and float32


def count(data: bytes | None) -> int:
    """How many int32/float32 values `data` holds."""
    return len(data or b"") // ITEM_BYTES


def head_ints(data: bytes | None, n: int) -> list[int]:
    """The first n ints only (a page showing part of a long completion unpacks only that part)."""
    return unpack_ints((data or b"")[: n * ITEM_BYTES])


def head_floats(data: bytes | None, n: int) -> list[float]:
    """The first n floats only."""
    return unpack_floats((data or b"")[: n * ITEM_BYTES])


def head_matrix(data: bytes | None, n_rows: int, n: int) -> list[list[float]]:
    """The first n columns of each of n_rows equal rows (see unpack_matrix)."""
    if n_rows == 0:
        return []
    values = count(data)
    if values % n_rows:
        raise ValueError(f"{values} values do not split into {n_rows} rows")
    row_bytes = values // n_rows * ITEM_BYTES
    cut = min(n * ITEM_BYTES, row_bytes)
    raw = data or b""
    return [unpack_floats(raw[i * row_bytes : i * row_bytes + cut]) for i in range(n_rows)]
