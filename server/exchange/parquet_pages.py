"""What a Parquet file's pages will decode to, read from their headers before Arrow reads them.

A footer's sizes (a column chunk's total_uncompressed_size, a row group's total_byte_size) are
what the writer says, and a hostile file can say anything there: Arrow allocates each page by its
own header (uncompressed_page_size, then num_values levels and slots), which must hold the truth
for the page to decompress at all. So an import over HTTP walks every column chunk's page
headers (Thrift's compact protocol, decoded here within the file's own bytes) and refuses a row
group whose pages would decode to more than the request may hold, before Arrow allocates any.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lens.server.core.errors import InvalidInput

# Arrow's decoded bytes a value of a page past its uncompressed bytes (which its decoded values
# about equal): its repetition and definition levels, 2 bytes each. A page of a billion nulls
# is a few bytes of RLE and 4 GB of levels.
VALUE_BYTES = 4
MAX_DEPTH = 16  # nesting of a page header's structs (a header has 3)

# Thrift compact protocol's type ids
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class _Damaged(ValueError):
    """Bytes that are not a Thrift compact struct within the page's column chunk."""


class _Compact:
    """A reader of Thrift's compact protocol over `data[pos:end]`: structs as {field id: value};
    every length is checked against the bytes left before anything is made of it."""

    def __init__(self, data: Any, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise _Damaged("a page header runs past its column chunk")
        value = int(self.data[self.pos])
        self.pos += 1
        return value

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise _Damaged("a varint of more than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def length(self, n: int) -> int:
        if n < 0 or n > self.end - self.pos:
            raise _Damaged(f"a length of {n:,} with {self.end - self.pos:,} bytes left")
        return n

    def value(self, kind: int, depth: int) -> Any:
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.pos += self.length(8)
            return None
        if kind == _BINARY:
            size = self.length(self.varint())  # read before pos moves past the bytes
            self.pos += size
            return None  # no page field read here is a string
        if kind in (_LIST, _SET):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            item = head & 0x0F
            for _ in range(self.length(size)):  # every item takes a byte at least
                self.value(item if item not in (_TRUE, _FALSE) else _BYTE, depth)
            return None
        if kind == _MAP:
            size = self.length(self.varint())
            if size:
                kinds = self.byte()
                for _ in range(size):
                    self.value(kinds >> 4, depth)
                    self.value(kinds & 0x0F, depth)
            return None
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise _Damaged(f"Thrift type {kind}")

    def struct(self, depth: int = 0) -> dict[int, Any]:
        if depth > MAX_DEPTH:
            raise _Damaged(f"structs nested more than {MAX_DEPTH} deep")
        fields: dict[int, Any] = {}
        last = 0
        while (head := self.byte()) != 0:
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            fields[last] = self.value(kind, depth)
        return fields


@dataclass(frozen=True)
class Page:
    """One page's header: what Arrow allocates to decode it."""

    uncompressed: int  # uncompressed_page_size
    compressed: int  # compressed_page_size: the bytes after the header
    values: int  # num_values (levels and slots), of a data or dictionary page

    @property
    def decodes_to(self) -> int:
        return self.uncompressed + VALUE_BYTES * self.values


def _page(reader: _Compact) -> Page:
    header = reader.struct()
    uncompressed, compressed = header.get(2), header.get(3)
    if not isinstance(uncompressed, int) or not isinstance(compressed, int):
        raise _Damaged("a page header without its sizes")
    # data page (5), dictionary page (7), data page v2 (8): num_values is their field 1
    values = next((h.get(1) for k in (5, 7, 8) if isinstance(h := header.get(k), dict)), 0)
    if uncompressed < 0 or compressed < 0 or not isinstance(values, int) or values < 0:
        raise _Damaged("a page header with a negative size")
    return Page(uncompressed, compressed, values)


def _chunk_pages(data: Any, column: Any) -> Iterator[Page]:
    """The pages of one column chunk, where Arrow reads them (its dictionary page's offset, or
    its first data page's, and total_compressed_size bytes on)."""
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    end = start + column.total_compressed_size
    if start < 0 or end > len(data):
        raise _Damaged("a column chunk outside the file")
    pos = start
    while pos < end:
        reader = _Compact(data, pos, end)
        page = _page(reader)
        pos = reader.pos + page.compressed
        yield page


def check_pages(path: Path, metadata: Any, names: set[str], most: int, *, where: str) -> None:
    """Refuse a row group whose pages' headers say they decode to more than `most` bytes (each
    page's uncompressed bytes and VALUE_BYTES a value, summed over the row group's columns that
    are read: those under `names`), or whose page headers are damaged; `where` names the limit
    in the refusal."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for i in range(metadata.num_row_groups):
            group = metadata.row_group(i)
            size = 0
            for j in range(group.num_columns):
                column = group.column(j)
                if column.path_in_schema.split(".")[0] not in names:
                    continue
                try:
                    for page in _chunk_pages(data, column):
                        size += page.decodes_to
                        if size > most:
                            raise InvalidInput(
                                f"row group {i + 1}: its pages decode to more than the {most:,} "
                                f"bytes {where} (column {column.path_in_schema} reaches "
                                f"{size:,} in its page headers, whatever the footer says)"
                            )
                except _Damaged as exc:
                    raise InvalidInput(
                        f"row group {i + 1}, column {column.path_in_schema}: damaged page "
                        f"headers ({exc})"
                    ) from None
