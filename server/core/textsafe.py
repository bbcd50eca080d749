"""Text the databases cannot hold, made storable: NUL and unpaired surrogates become U+FFFD;
and JSON every reader can parse: NaN and infinities (which JSON lacks) become null.

A Python str can hold what UTF-8 cannot encode (a lone surrogate, e.g. from a decoder run with
`surrogateescape` or a user's function slicing a pair apart) and PostgreSQL refuses NUL in text.
Model output and user-given names are such text: refusing the write would lose the step (or stop
a launched run), so the engine cleans every string it sends instead (install(), from
server.store.db.make_engine), on SQLite and PostgreSQL alike so that an export from one imports into
the other. RolloutRecord cleans its text fields as they are set (a prompt is hashed before any
SQL sees it), and responses clean what they send when encoding fails (rows stored before this).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson
from sqlalchemy import Engine, event

REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> str:
    """`text` with NUL and unpaired surrogates replaced by U+FFFD (a surrogate pair is joined
    into its character); the same object when there is nothing to replace (the usual case)."""
    if _UNSTORABLE.search(text) is None:
        return text
    # Through UTF-16: a pair becomes its character, a lone half cannot and is replaced.
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return joined.replace("\x00", REPLACEMENT)


def utf8(text: str) -> bytes:
    """`text` in UTF-8; a lone surrogate (text stored before writes were cleaned) as U+FFFD, as
    storable makes it. Clean text is encoded once, with no scan before."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return storable(text).encode("utf-8")


def encodable(text: str) -> bool:
    """UTF-8 can encode `text`: it holds no surrogate code point (a JSON text's `\\ud800`, or a
    pair left as its two halves)."""
    return _SURROGATE.search(text) is None


def storable_value(value: Any) -> Any:
    """Strings anywhere in a JSON-like value (keys too) made storable; the same object when
    there is nothing to replace (dicts shared by a group's rollouts stay shared)."""
    if isinstance(value, dict | list | tuple) and _clean_json(value):
        return value
    return _cleaned(value) if _unstorable_inside(value) else value


def _clean_json(value: Any) -> bool:
    """True when no string in `value` holds NUL or a surrogate, proven by one orjson encoding
    in C (a rollout's meta and token pieces, set on every rollout of every step: the walk below
    cost the writer's thread a Python call a string). orjson refuses a surrogate and writes NUL
    as \\u0000, and reaches every string the walk does (dict keys, list and tuple items,
    subclasses); False (walk it) when it refuses the value or the escape is found."""
    try:
        return b"\\u0000" not in orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return False


def _unstorable_inside(value: Any) -> bool:
    if isinstance(value, str):
        return _UNSTORABLE.search(value) is not None
    if isinstance(value, dict):
        return any(_unstorable_inside(k) or _unstorable_inside(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_unstorable_inside(v) for v in value)
    return False


def _cleaned(value: Any) -> Any:
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {_cleaned(k): _cleaned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cleaned(v) for v in value]
    return value


def finite_value(value: Any) -> Any:
    """NaN and infinities anywhere in a JSON-like value made None; the same object when there
    is none."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_value(v) for v in value]
    return value


def finite_json(value: Any, **options: Any) -> str:
    """json.dumps(value, **options) with NaN and infinities written as null: json.dumps writes
    them as the tokens NaN and Infinity, which are not JSON (SQLite's json_extract and
    PostgreSQL's json type refuse them, so one such value broke every page reading its row)."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:  # a non-finite float somewhere: rare, so only then is the value walked
        return json.dumps(finite_value(value), allow_nan=False, **options)


def json_dumps(value: Any) -> str:
    """The engines' JSON serializer: as SQLAlchemy's default (json.dumps), strings cleaned first
    and NaN and infinities written as null (finite_json) in every JSON column.

    ensure_ascii (json's default) would store a lone surrogate as a `\\ud800` escape that reads
    back as the same unencodable str, so the walk is needed, not just the escaping."""
    return finite_json(storable_value(value))


def _clean_parameters(parameters: Any) -> Any:
    if isinstance(parameters, dict):
        return {k: storable(v) if isinstance(v, str) else v for k, v in parameters.items()}
    if isinstance(parameters, tuple):
        return tuple(storable(v) if isinstance(v, str) else v for v in parameters)
    if isinstance(parameters, list):  # executemany: a list of the above
        return [_clean_parameters(p) for p in parameters]
    return parameters


# A statement's execution options saying its strings were made storable before (the write
# path's rollout rows: checking half a million strings a step again cost more than inserting them).
CLEAN_ALREADY = {"rollout_lens_storable": True}


def install(engine: Engine) -> None:
    """Clean every string parameter `engine` sends (text columns, names, errors, notes), but
    for statements run with CLEAN_ALREADY."""

    @event.listens_for(engine, "before_cursor_execute", retval=True)
    def _storable_parameters(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if context is not None and context.execution_options.get("rollout_lens_storable"):
            return statement, parameters
        return statement, _clean_parameters(parameters)


def clip(text: str | None, limit: int) -> str:
    """At most `limit` characters of `text`, with an ellipsis when cut (long names in lists)."""
    text = text or ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


# Terminal controls: C0 (ESC starts colour and title sequences, BEL ends OSC), DEL, C1 (CSI and
# OSC in one byte) and the bidirectional overrides that reorder what a terminal shows.
_TERMINAL_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """`text` with every terminal control character removed: what a command prints of a run
    (its name, status, error) can recolour, retitle or rewrite no terminal."""
    return _TERMINAL_CONTROLS.sub("", str(text))


# OWASP's rule for CSV injection: a cell a spreadsheet would read as a formula.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text: a string beginning with = + - @ tab or CR gets a
    leading `'` (OWASP); numbers and other values unchanged (-0.5 stays a number)."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value
