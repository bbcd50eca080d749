"""A Parquet file whose footer lies about its sizes: every column chunk's total_uncompressed_size
and every row group's total_byte_size rewritten to `said` bytes, the pages left as they are (a
hostile import that a check of the footer alone lets through). The footer (Thrift's compact
protocol) is decoded and encoded again here, every field kept as it was but those."""

from __future__ import annotations

import struct
from typing import Any

_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
Field = tuple[int, int, Any]  # (id, type, value)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int) -> Any:
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.pos += 8
            return self.data[self.pos - 8 : self.pos]
        if kind == _BINARY:
            n = self.varint()
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if kind in (_LIST, _SET):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            item = head & 0x0F
            if item in (_TRUE, _FALSE):
                return item, [self.byte() == 1 for _ in range(size)]
            return item, [self.value(item) for _ in range(size)]
        if kind == _MAP:
            size = self.varint()
            kinds = self.byte() if size else 0
            pairs = [(self.value(kinds >> 4), self.value(kinds & 0x0F)) for _ in range(size)]
            return kinds, pairs
        if kind == _STRUCT:
            return self.struct()
        raise ValueError(f"Thrift type {kind}")

    def struct(self) -> list[Field]:
        fields: list[Field] = []
        last = 0
        while (head := self.byte()) != 0:
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            fields.append((last, kind, self.value(kind)))
        return fields


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        if n < 0x80:
            out.append(n)
            return bytes(out)
        out.append((n & 0x7F) | 0x80)
        n >>= 7


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _value(kind: int, value: Any) -> bytes:
    if kind in (_TRUE, _FALSE):
        return b""  # a struct field's bool is its type
    if kind == _BYTE:
        return bytes([value])
    if kind in (_I16, _I32, _I64):
        return _zigzag(value)
    if kind == _DOUBLE:
        return bytes(value)
    if kind == _BINARY:
        return _varint(len(value)) + bytes(value)
    if kind in (_LIST, _SET):
        item, items = value
        head = bytes([len(items) << 4 | item]) if len(items) < 15 else bytes([0xF0 | item])
        size = b"" if len(items) < 15 else _varint(len(items))
        if item in (_TRUE, _FALSE):
            return head + size + bytes(1 if v else 2 for v in items)
        return head + size + b"".join(_value(item, v) for v in items)
    if kind == _MAP:
        kinds, pairs = value
        if not pairs:
            return b"\x00"
        body = b"".join(_value(kinds >> 4, k) + _value(kinds & 0x0F, v) for k, v in pairs)
        return _varint(len(pairs)) + bytes([kinds]) + body
    if kind == _STRUCT:
        return _struct(value)
    raise ValueError(f"Thrift type {kind}")


def _struct(fields: list[Field]) -> bytes:
    out = bytearray()
    last = 0
    for ident, kind, value in fields:
        if kind in (_TRUE, _FALSE):
            kind = _TRUE if value else _FALSE
        delta = ident - last
        if 0 < delta <= 15:
            out.append(delta << 4 | kind)
        else:
            out.append(kind)
            out += _zigzag(ident)
        out += _value(kind, value)
        last = ident
    out.append(0)
    return bytes(out)


def _said(fields: list[Field], ids: dict[int, int], said: int) -> list[Field]:
    return [(i, k, said if i in ids else v) for i, k, v in fields]


def footer_lies(data: bytes, said: int) -> bytes:
    """`data` (a Parquet file) with its footer's uncompressed sizes all `said` bytes."""
    (length,) = struct.unpack("<I", data[-8:-4])
    start = len(data) - 8 - length
    meta = _Reader(data[start:-8]).struct()
    rewritten = []
    for ident, kind, value in meta:
        if ident == 4:  # row_groups
            groups = []
            for group in value[1]:
                fields = []
                for gi, gk, gv in _said(group, {2: 0}, said):  # total_byte_size
                    if gi == 1:  # columns: each ColumnChunk's meta_data (3)
                        chunks = [
                            [
                                (ci, ck, _said(cv, {6: 0}, said) if ci == 3 else cv)
                                for ci, ck, cv in chunk
                            ]
                            for chunk in gv[1]
                        ]
                        gv = (gv[0], chunks)
                    fields.append((gi, gk, gv))
                groups.append(fields)
            value = (value[0], groups)
        rewritten.append((ident, kind, value))
    footer = _struct(rewritten)
    return data[:start] + footer + struct.pack("<I", len(footer)) + b"PAR1"
