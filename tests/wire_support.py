"""Wire bodies to tamper with (server.exchange.wire): a real step's frame taken apart into its
three Arrow IPC streams, changed, and put together again; and the pages of a recorded run."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import zstandard
from fastapi.testclient import TestClient
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.exchange import wire

PARTS = ("step", "rollouts", "pieces")


def parts_of(record: StepRecord, control_tokens: Sequence[str]) -> list[bytes]:
    """The three IPC streams of `record`'s frame, as the recorder codes it."""
    frame = wire.encode_step(record, control_tokens, np.zeros(0, np.int64)).frame
    raw = zstandard.ZstdDecompressor().decompress(frame)
    parts, at = [], 0
    for _ in PARTS:
        (n,) = struct.unpack_from("<Q", raw, at)
        parts.append(raw[at + 8 : at + 8 + n])
        at += 8 + n
    return parts


def ipc(table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> bytes:
    """`table` as one IPC stream (with `metadata` as its schema's, when given)."""
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def read(part: bytes) -> pa.Table:
    return pa.ipc.open_stream(part).read_all()


def frame(parts: Sequence[bytes]) -> bytes:
    """A step's frame of these streams (a zstd frame that says its size, as the sender's)."""
    raw = b"".join(struct.pack("<Q", len(p)) + p for p in parts)
    return zstandard.ZstdCompressor(write_content_size=True).compress(raw)


def body(*frames: bytes) -> bytes:
    return wire.body(frames)


def with_rollout_columns(
    record: StepRecord, control_tokens: Sequence[str], **columns: Callable[[int], pa.Array]
) -> bytes:
    """The frame of `record` with rollout columns replaced: each `make(rows)` gives the new
    column (as the sender could not, e.g. a meta text holding `Infinity`)."""
    parts = parts_of(record, control_tokens)
    table = read(parts[1])
    for name, make in columns.items():
        at = table.schema.get_field_index(name)
        table = table.set_column(at, table.schema.field(at), make(table.num_rows))
    return frame([parts[0], ipc(table), parts[2]])


def record_run(client: TestClient, key: str, control_tokens: Sequence[str] = ()) -> int:
    """A run created as a recorder creates it (POST /api/record/runs); its id."""
    answer = client.post(
        "/api/record/runs", json={"key": key, "name": key, "control_tokens": list(control_tokens)}
    )
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def run_pages(
    client: TestClient, run_id: int, groups: Mapping[int, Iterable[int]], *, other: int
) -> dict[str, int]:
    """Every page of a run and its JSON twin, each step's and each group's (`groups`: step →
    its groups), and its comparison with run `other` → each one's status."""
    paths = [
        "/",
        f"/runs/{run_id}",
        f"/api/runs/{run_id}",
        f"/api/runs/{run_id}/progress",
        f"/api/runs/{run_id}/series",
        f"/runs/{run_id}/rollouts?sort=reward&order=desc",
        f"/api/runs/{run_id}/rollouts?sort=advantage",
        f"/api/runs/{run_id}/export",
    ]
    for step, in_step in groups.items():
        paths += [
            f"/runs/{run_id}/steps/{step}",
            f"/api/runs/{run_id}/steps/{step}",
            f"/runs/{run_id}/steps/{step}/card",
            f"/compare?runs={other},{run_id}&step={step}",
            f"/api/compare?runs={other},{run_id}&step={step}",
        ]
        for group in in_step:
            paths += [
                f"/runs/{run_id}/steps/{step}/groups/{group}",
                f"/api/runs/{run_id}/steps/{step}/groups/{group}",
            ]
    statuses = {path: client.get(path).status_code for path in paths}
    for sort in ("sum_logprob", "true_score"):  # each page of a sort, by its cursor (NULLs, ±inf)
        path = f"/api/runs/{run_id}/rollouts?sort={sort}&limit=4"
        params: dict[str, str] = {}
        for page in range(20):
            answer = client.get(path, params=params)
            statuses[f"{path}&page={page}"] = answer.status_code
            following = answer.json().get("next") if answer.status_code == 200 else None
            if not following:
                break
            params = {"after": following}
    return statuses
