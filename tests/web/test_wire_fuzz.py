"""The recording wire fuzzed (server.exchange.wire through POST /api/record/runs/{id}/steps), the
real app in process on an SQLite file: real steps' frames mutated at every level — their Arrow
tables (columns missing, extra, retyped, renamed, nulled, values at and past the bounds, rows
added and removed), the step schema's metadata, the IPC streams' bytes and lengths, the zstd
frames and the body's frame lengths. Every answer is a 2xx or a 4xx, never a 5xx, and after a 4xx
nothing of the body was written. And the bodies that were 500s: control tokens nested 100,000
deep, a lone surrogate in a JSON body."""

from __future__ import annotations

import itertools
import json
import random
import re
import struct
from datetime import UTC, datetime
from typing import Any

import httpx
import pyarrow as pa
import pytest
import zstandard
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange import wire
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_rollouts, recorded_steps, rollouts_per_step
from tests.wire_support import PARTS, body, frame, ipc, parts_of, read, record_run

CONTROL = ("<tool>", "</tool>", "</assistant>")
VOCAB = {i: piece for i, piece in enumerate(["<tool>", "</tool>", "</assistant>", "Ġthe", "Ċ"])}
VOCAB.update({10 + i: f"tool_{i:02d}" for i in range(64)})


def _record(step: int) -> StepRecord:
    """Two groups: one sent with its tokens' pieces (its text rebuilt from them), one without;
    a rollout with nothing measured."""
    rng = random.Random(0)  # the same rollouts each step: the draws below depend on no step
    rollouts: list[RolloutRecord] = []
    for group in range(2):
        for r in make_rollouts(rng, group_size=3, listed=4):
            r.group = group
            if group == 0:
                ids = [0, 10 + rng.randrange(64), 1, 3, 4, 2]
                r.completion_ids = ids
                r.tokens = [VOCAB[i] for i in ids]
                r.completion = "".join(r.tokens)
                r.token_logprobs = [-rng.random() * 20 for _ in ids]
                r.control_probs = {t: [rng.random() for _ in ids] for t in CONTROL}
            if r.index == 2:
                r.token_logprobs = []
                r.control_probs = {}
            rollouts.append(r)
    return StepRecord(
        step=step,
        rollout_step=step,
        values={"reward_mean": 0.5, "loss": None},
        rollouts=rollouts,
        metrics={"trl/custom": 0.5},
        recorded_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


# --- what a mutation puts in a column -------------------------------------------------------------

_INTS = [-1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]
_FLOATS = [float("nan"), float("inf"), float("-inf"), 1.7e308, -1.7e308, -0.0, 5e-324]
_TEXTS = ["", "x" * 5000, "\x00", "{", "[]", "null", "[" * 5000, '{"a": 1e999}', '{"a": NaN}']
_TEXTS += ['{"a": ' * 70 + "1" + "}" * 70, '"just a string"', '{"tokens": 1}', "\u202e\ufffd"]
_BYTES = [b"", b"\x00" * 7, b"\xff" * 64, b"\x01\x00\x00\x00\x05\x00\x00\x00"]
_TIMES = [0, -(2**62), 2**62, 253402300800 * 10**6]  # µs: 1970, far past, far future, year 10000


def _values_of(kind: pa.DataType, data: st.DataObject) -> list[Any]:
    if pa.types.is_integer(kind):
        return [data.draw(st.sampled_from(_INTS))]
    if pa.types.is_floating(kind):
        return [data.draw(st.sampled_from(_FLOATS))]
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return [data.draw(st.one_of(st.sampled_from(_TEXTS), st.text(max_size=20)))]
    if pa.types.is_binary(kind):
        return [data.draw(st.one_of(st.sampled_from(_BYTES), st.binary(max_size=40)))]
    if pa.types.is_boolean(kind):
        return [data.draw(st.sampled_from([True, False, None]))]
    if pa.types.is_timestamp(kind):
        return [data.draw(st.sampled_from(_TIMES))]
    if pa.types.is_map(kind):
        name = data.draw(st.sampled_from(["", "x" * 201, "reward_mean", "a"]))
        pairs = [(name, data.draw(st.sampled_from(_FLOATS)))]
        return [pairs + pairs if data.draw(st.booleans()) else pairs]
    return [None]


def _at_bounds(table: pa.Table, data: st.DataObject) -> pa.Table:
    """One column's values replaced by values at or past its bounds (its type kept)."""
    at = data.draw(st.integers(0, table.num_columns - 1))
    field = table.schema.field(at)
    kind = field.type
    if pa.types.is_dictionary(kind):  # the prompts: an index past the dictionary
        index = data.draw(st.sampled_from([-1, 5, 2**31 - 1]))
        column = pa.DictionaryArray.from_arrays(
            pa.array([index] * table.num_rows, kind.index_type),
            pa.array(["p"], kind.value_type),
            safe=False,
        )
        return table.set_column(at, field, column)
    values = _values_of(kind, data) * table.num_rows
    if pa.types.is_timestamp(kind):
        column = pa.array(values, pa.int64()).cast(kind)
    else:
        try:
            column = pa.array(values, kind)
        except (pa.ArrowException, OverflowError):
            column = pa.nulls(table.num_rows, kind)
    return table.set_column(at, field, column)


_TYPES = [pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.large_string(), pa.binary()]
_TYPES += [pa.bool_(), pa.null(), pa.list_(pa.int64()), pa.timestamp("s")]


def _retyped(table: pa.Table, data: st.DataObject) -> pa.Table:
    at = data.draw(st.integers(0, table.num_columns - 1))
    kind = data.draw(st.sampled_from(_TYPES))
    try:
        column = table.column(at).cast(kind, safe=False)
    except (pa.ArrowException, NotImplementedError):
        column = pa.nulls(table.num_rows, kind)
    return table.set_column(at, pa.field(table.schema.field(at).name, kind), column)


def _schema_change(table: pa.Table, data: st.DataObject) -> pa.Table:
    how = data.draw(st.sampled_from(["drop", "extra", "rename", "nulls", "retype", "swap"]))
    at = data.draw(st.integers(0, table.num_columns - 1))
    name = table.schema.field(at).name
    if how == "drop":
        return table.remove_column(at)
    if how == "extra":
        return table.append_column("extra", pa.array([1] * table.num_rows, pa.int64()))
    if how == "rename":
        return table.rename_columns([n if n != name else name + "_" for n in table.column_names])
    if how == "nulls":
        return table.set_column(at, name, pa.nulls(table.num_rows, table.schema.field(at).type))
    if how == "swap" and table.num_columns > 1:
        names = table.column_names
        order = [*names[:at], *names[at + 1 :], name]
        return table.select(order)
    return _retyped(table, data)


def _rows_change(table: pa.Table, data: st.DataObject) -> pa.Table:
    how = data.draw(st.sampled_from(["none", "fewer", "twice"]))
    if how == "none":
        return table.slice(0, 0)
    if how == "fewer":
        return table.slice(0, max(table.num_rows - 1, 0))
    return pa.concat_tables([table, table])


_CONTROL_TEXTS = [
    "[" * 100_000,  # json's decoder recurses: a RecursionError
    "[" * 2_000 + "]" * 2_000,
    '{"a": ' * 3_000,
    "{}",
    "null",
    '"<tool>"',
    "[1, 2, 3]",
    '[["<tool>"]]',
    json.dumps(list(CONTROL[:2])),
    json.dumps(list(CONTROL) * 1000),
    "[" + "1," * 100_000 + "1]",
    "not json",
]


def _metadata(data: st.DataObject) -> dict[bytes, bytes]:
    """The step schema's metadata: its version mostly right (else its control tokens are never
    read), its control tokens anything."""
    version = data.draw(st.sampled_from([b"1", b"1", b"1", b"2", b"", None]))
    tokens: bytes | None = data.draw(
        st.sampled_from([t.encode() for t in _CONTROL_TEXTS] + [b"\xff\xfe", b"random", None])
    )
    if tokens == b"random":
        tokens = data.draw(st.binary(max_size=20))
    out = {b"version": version, b"control_tokens": tokens}
    return {k: v for k, v in out.items() if v is not None}


# --- the mutations: one layer of the body each ---------------------------------------------------


def _mutated_frame(record: StepRecord, layer: str, data: st.DataObject) -> bytes:
    parts = parts_of(record, CONTROL)
    tables = [read(p) for p in parts]
    metadata = dict(tables[0].schema.metadata or {})
    if layer == "tables":
        for _ in range(data.draw(st.integers(1, 2))):
            what = data.draw(st.sampled_from(["bounds", "bounds", "bounds", "schema", "rows"]))
            which = data.draw(st.integers(0, len(PARTS) - 1))
            if what == "bounds" and tables[which].num_rows:
                tables[which] = _at_bounds(tables[which], data)
            elif what == "schema":
                tables[which] = _schema_change(tables[which], data)
            elif what == "rows":
                tables[which] = _rows_change(tables[which], data)
    elif layer == "metadata":
        metadata = _metadata(data)
    streams = [ipc(t, metadata if i == 0 else None) for i, t in enumerate(tables)]
    raw = b"".join(struct.pack("<Q", len(p)) + p for p in streams)
    if layer == "ipc":
        raw = _ipc_bytes(raw, streams, data)
    sized = layer != "zstd" or data.draw(st.booleans())
    out = zstandard.ZstdCompressor(write_content_size=sized).compress(raw)
    if layer == "zstd" and sized:
        out = bytearray(out)
        if data.draw(st.booleans()):
            out[_position(data, len(out))] ^= 0xFF
        else:
            del out[_position(data, len(out)) :]
        out = bytes(out)
    return out


def _ipc_bytes(raw: bytes, streams: list[bytes], data: st.DataObject) -> bytes:
    """The decompressed frame's bytes changed: an IPC stream's (its flatbuffers, its buffers),
    a stream's length cut short or overstated, the frame cut, or bytes after its streams."""
    how = data.draw(st.sampled_from(["flip", "lengths", "lengths", "cut", "trailing"]))
    if how == "flip":
        changed = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 8))):
            changed[_position(data, len(raw))] = data.draw(st.integers(0, 255))
        return bytes(changed)
    if how == "lengths":
        which = data.draw(st.integers(0, 2))
        at = sum(8 + len(s) for s in streams[:which])
        length = len(streams[which]) + data.draw(st.sampled_from([-1, -100, 1, 2**20, 2**63]))
        return raw[:at] + struct.pack("<Q", max(length, 0) % 2**64) + raw[at + 8 :]
    if how == "cut":
        return raw[: _position(data, len(raw) + 1)]
    return raw + data.draw(st.binary(min_size=1, max_size=16))


def _position(data: st.DataObject, size: int) -> int:
    """A position in `size` bytes, drawn without knowing `size` (a frame's compressed length
    varies with its step number: hypothesis needs the same draws for the same choices)."""
    return data.draw(st.integers(0, 2**16)) % max(size, 1)


def _mutated_body(frames: list[bytes], data: st.DataObject) -> bytes:
    """The body of `frames` with its first frame's length cut short or overstated, bytes
    after its last, or another magic."""
    out = body(*frames)
    how = data.draw(st.sampled_from(["length", "length", "trailing", "magic", "empty"]))
    if how == "length":
        length = len(frames[0]) + data.draw(st.sampled_from([-1, -7, 1, 4096, 2**32 - 1 - 4096]))
        return wire.MAGIC + struct.pack("<I", max(length, 0) % 2**32) + out[8:]
    if how == "trailing":
        return out + data.draw(st.binary(min_size=1, max_size=7))
    if how == "magic":
        return b"RLW2" + out[4:]
    return wire.MAGIC


_INDEX = re.compile(r"\[[^]]*\]")


_RUNS = itertools.count(1)


def _new_run(client: TestClient) -> int:
    """A run a recorder made, with its step 10 written."""
    run_id = record_run(client, f"fuzz-key-{next(_RUNS):06d}", CONTROL)
    first = wire.encode_step(_record(10), CONTROL, _none()).frame
    assert client.post(f"/api/record/runs/{run_id}/steps", content=body(first)).status_code == 200
    return run_id


@pytest.fixture
def recorded(client: TestClient) -> int:
    return _new_run(client)


def _none() -> Any:
    import numpy as np

    return np.zeros(0, np.int64)


def _send(
    client: TestClient, session_factory: sessionmaker[Session], run_id: int, sent: bytes
) -> httpx.Response:
    """POST a body: never a 5xx, and after a 4xx the run as it was (nothing half-written)."""
    before = (recorded_steps(session_factory, run_id), rollouts_per_step(session_factory, run_id))
    answer = client.post(f"/api/record/runs/{run_id}/steps", content=sent)
    assert answer.status_code < 500, (answer.status_code, answer.text[:500])
    if answer.status_code >= 400:
        after = (
            recorded_steps(session_factory, run_id),
            rollouts_per_step(session_factory, run_id),
        )
        assert after == before, answer.text[:500]
        assert answer.json()["detail"]
    return answer


@pytest.mark.parametrize("layer", ["tables", "metadata", "ipc", "zstd", "body"])
@settings(
    max_examples=15,  # a layer: 75 bodies in all, about 10 s (each a run, its first step, a body)
    deadline=None,
    # The same examples on every run, from a seed derived from this test (no example database
    # is read or written): what CI finds, a laptop finds, and a change to the wire is tried
    # against the same bodies before and after.
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_no_mutated_body_is_a_server_error_or_half_written(
    client: TestClient, session_factory: sessionmaker[Session], layer: str, data: st.DataObject
) -> None:
    """A run of its own each example (a step number at the bound, once written, would make
    every later step an earlier one: another matter); steps 20 and 30 after its 10, the last
    frame changed at `layer` (the body's framing for `body`)."""
    run_id = _new_run(client)
    steps = [20, 30][: data.draw(st.integers(1, 2))]
    frames = [wire.encode_step(_record(s), CONTROL, _none()).frame for s in steps]
    if layer != "body":
        frames[-1] = _mutated_frame(_record(steps[-1]), layer, data)
    answer = _send(
        client,
        session_factory,
        run_id,
        _mutated_body(frames, data) if layer == "body" else body(*frames),
    )
    field = answer.json().get("field") or "" if answer.status_code == 422 else ""
    event(f"{answer.status_code} {re.sub(_INDEX, '', field)}")  # --hypothesis-show-statistics


@pytest.mark.parametrize("tokens", _CONTROL_TEXTS, ids=range(len(_CONTROL_TEXTS)))
def test_every_control_tokens_metadata_is_answered_2xx_or_4xx(
    client: TestClient, session_factory: sessionmaker[Session], recorded: int, tokens: str
) -> None:
    """Each control-tokens text of the fuzz's metadata, sent once for certain."""
    parts = parts_of(_record(20), CONTROL)
    step = ipc(read(parts[0]), {b"version": b"1", b"control_tokens": tokens.encode()})
    answer = _send(client, session_factory, recorded, body(frame([step, parts[1], parts[2]])))
    assert answer.status_code == 422
    assert len(recorded_steps(session_factory, recorded)) == 1


# --- the bodies that were 500s ---------------------------------------------------------------------


def test_control_tokens_nested_past_the_recursion_limit_are_refused(
    client: TestClient, session_factory: sessionmaker[Session], recorded: int
) -> None:
    parts = parts_of(_record(20), CONTROL)
    step = ipc(read(parts[0]), {b"version": b"1", b"control_tokens": b"[" * 100_000})
    answer = client.post(
        f"/api/record/runs/{recorded}/steps", content=body(frame([step, parts[1], parts[2]]))
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "steps[0].control_tokens"
    assert len(recorded_steps(session_factory, recorded)) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"name": "\ud800"},
        {"name": "a\udc00b"},
        {"notes": ["fine", "\ud83d"]},
        {"config": {"lr": {"\udfff": 1}}},
        {"config": {"tags": ["x", "bad \ud800"]}},
        {"control_tokens": ["<tool>", "\ud800"]},
        {"model": "\ud800", "key": "\ud800bad-key"},
    ],
)
def test_text_that_is_not_unicode_is_refused_naming_the_field(
    client: TestClient, change: dict[str, Any]
) -> None:
    """A JSON body's `\\ud800` decodes to text UTF-8 cannot hold: a 422 naming the field (its
    own echo of the input once made the 422 itself a 500), and no run."""
    spec = {"key": "unicode-key-0001", "name": "n"} | change
    text = json.dumps(spec)  # ASCII, the lone surrogates as \\uXXXX escapes
    answer = client.post(
        "/api/record/runs", content=text, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    named = [k for k in change if k != "key"]
    assert all(f"{k}" in detail for k in named) and "not valid Unicode" in detail, detail
    assert client.get("/api/runs").json()["runs"] == []


def test_a_finish_error_that_is_not_unicode_is_refused(client: TestClient, recorded: int) -> None:
    text = json.dumps({"status": "failed", "error": "boom \ud800"})
    answer = client.post(
        f"/api/record/runs/{recorded}/finish",
        content=text,
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 422, answer.text
    assert "error" in answer.json()["detail"]
