"""What an imported file may hold, checked as it is read (before anything is written): lines of
bounded length read one at a time, JSON of bounded nesting, and numbers in the ranges the
databases store. A file past a bound is refused naming the file and line, never a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from rollout_lens.server.core.errors import InvalidInput

MAX_LINE_BYTES = 128 * 2**20  # a JSON line (one rollout with every array); longer is refused
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a line (configs and metas are a few deep)
MAX_TOKENS = 2**20  # token ids of one completion (1,048,576): its arrays are held whole in memory
MAX_INT32 = 2**31 - 1  # steps, groups, indexes, token ids and run columns are 32-bit integers
MIN_INT32 = -(2**31)
# A request over HTTP (a recording body, an imported file) decodes to at most DECODE_FACTOR × its
# byte cap (ROLLOUT_LENS_RECORD_MAX_MB) held at once, each size taken before it is allocated.
DECODE_FACTOR = 4
JSON_BYTES = 24  # Python's objects a byte of JSON text, at most (`[{},{},…]`: 72 bytes a 3)


def lines(f: IO[bytes], where: str, *, most: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(number, raw) for each line of `f`, one at a time; a line longer than `most` bytes is
    refused without reading the rest of it (memory stays at one line)."""
    number = 0
    while True:
        raw = f.readline(most + 1)
        if not raw:
            return
        number += 1
        if len(raw) > most:
            raise InvalidInput(
                f"{where} line {number}".strip()
                + f": longer than {most:,} bytes, the most an imported line may hold here"
            )
        yield number, raw


def line_limit(max_bytes: int | None) -> int:
    """The longest line an import reads: MAX_LINE_BYTES, or over HTTP what the request's decode
    budget holds of its JSON at the worst (DECODE_FACTOR × the byte cap / JSON_BYTES)."""
    if max_bytes is None:
        return MAX_LINE_BYTES
    return min(MAX_LINE_BYTES, DECODE_FACTOR * max_bytes // JSON_BYTES)


def loads(text: str | bytes, where: str) -> Any:
    """JSON text decoded, nested at most MAX_JSON_DEPTH deep (deeper is refused with a message,
    not a RecursionError); json.JSONDecodeError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(where) from None
    check_depth(value, where)
    return value


def check_depth(value: Any, where: str) -> None:
    """InvalidInput if arrays and objects nest deeper than MAX_JSON_DEPTH (walked without
    recursion, so any depth can be checked)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(where)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _too_deep(where: str) -> InvalidInput:
    return InvalidInput(
        f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep, more than an imported "
        "record may hold"
    )


def check_step(digits: str, where: str) -> int:
    """A step number written in decimal digits (a file name's), one the pages can show: 0 to
    MAX_INT32 (a thousand digits are not turned into a number first)."""
    if len(digits) > len(str(MAX_INT32)) or int(digits) > MAX_INT32:
        raise InvalidInput(
            f"{where}: step {digits[:40]} is out of range (steps go from 0 to {MAX_INT32:,})"
        )
    return int(digits)
