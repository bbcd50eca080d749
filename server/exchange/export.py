"""Export a run as a stream of bytes: JSONL or Parquet, the whole run or its per-step series.

Everything is read in batches (steps a page at a time, rollouts through a streaming cursor) and
handed out as chunks, so a 10,000-step run never sits in memory; the CLI writes the chunks to a
file, the API streams them as a download. pyarrow (and numpy with it) is imported only when a
Parquet file is asked for: the web process stays light.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.display import iso
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.step_views import json_types
from rollout_lens.server.core.textsafe import csv_cell, storable, utf8
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.exchange.schema import (
    META_RUN,
    META_STEPS,
    dumps,
    end_record,
    rollout_record,
    run_record,
    step_record,
)
from rollout_lens.server.store.models import RunRow
from rollout_lens.server.store.serialize import rollout_dict
from sqlalchemy.orm import Session

FORMATS = ("jsonl", "parquet", "csv")
WHATS = ("rollouts", "steps")
MEDIA_TYPES = {
    "jsonl": "application/x-ndjson",
    "parquet": "application/vnd.apache.parquet",
    "csv": "text/csv",
}
CHUNK_BYTES = 1 << 16  # JSONL/CSV text is handed out in chunks of about this size
ROW_GROUP = 1000  # rollouts (or steps) per Parquet row group: one batch in memory at a time
STEP_PAGE = 500  # steps read per query


def check(fmt: str, what: str) -> None:
    """Refuse a format/content pair that does not exist, naming the ones that do."""
    if fmt not in FORMATS:
        raise InvalidInput(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if what not in WHATS:
        raise InvalidInput(f"unknown export content {what!r}: use rollouts or steps")
    if fmt == "csv" and what == "rollouts":
        raise InvalidInput("rollouts export as jsonl or parquet (csv holds the per-step series)")


def filename(run_id: int, fmt: str, what: str) -> str:
    """The file name a download is saved under."""
    return f"rollout-lens-run-{run_id}-{what}.{fmt}"


def export_chunks(
    session: Session, *, run_id: int, fmt: str = "jsonl", what: str = "rollouts"
) -> Iterator[bytes]:
    """The export file of a run, chunk by chunk (raises before the first chunk if it cannot)."""
    check(fmt, what)
    run = store.get_run(session, run_id=run_id)
    if what == "steps":
        return _steps_chunks(session, run, fmt)
    if fmt == "parquet":
        return _parquet_run(session, run)
    return _text_chunks(_jsonl_run(session, run))


# --- the whole run ------------------------------------------------------------------------------


def _jsonl_run(session: Session, run: RunRow) -> Iterator[str]:
    """Lines: the run, each step followed by the rollouts generated at it, then the end record."""
    tokens = list(run.control_tokens)
    texts = store.token_texts(session, run_id=run.id)
    yield dumps(run_record(run)) + "\n"
    counts = {"steps": 0, "rollouts": 0}
    rollouts = iter(store.iter_rollouts(session, run_id=run.id, batch=ROW_GROUP))
    pending = next(rollouts, None)

    def rollouts_up_to(step: int | None) -> Iterator[str]:
        nonlocal pending
        while pending is not None and (step is None or pending[0].step <= step):
            counts["rollouts"] += 1
            yield dumps(rollout_record(pending[0], pending[1], tokens, texts)) + "\n"
            pending = next(rollouts, None)

    for step, metrics in store.iter_steps(session, run_id=run.id, page=STEP_PAGE):
        yield from rollouts_up_to(step.step - 1)  # any generated at a step with no step row
        counts["steps"] += 1
        yield dumps(step_record(step, metrics)) + "\n"
        yield from rollouts_up_to(step.step)
    yield from rollouts_up_to(None)
    yield dumps(end_record(**counts)) + "\n"


def _text_chunks(lines: Iterator[str]) -> Iterator[bytes]:
    """Join lines into chunks of about CHUNK_BYTES, UTF-8 encoded."""
    return byte_chunks(utf8(line) for line in lines)  # a lone surrogate as U+FFFD, as pages show it


def byte_chunks(lines: Iterable[bytes]) -> Iterator[bytes]:
    """Join encoded lines into chunks of about CHUNK_BYTES (a streamed answer's pieces)."""
    buffer: list[bytes] = []
    size = 0
    for line in lines:
        buffer.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            yield b"".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield b"".join(buffer)


class _Drain(io.RawIOBase):
    """A write-only file that keeps what was written until taken (a pipe for ParquetWriter).

    `tell` counts every byte ever written: the Parquet footer records absolute offsets.
    """

    def __init__(self) -> None:
        super().__init__()
        self._chunks: list[bytes] = []
        self._position = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._chunks.append(chunk)
        self._position += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._position

    def take(self) -> bytes:
        """Everything written since the last take."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


# Parquet: the rollout's JSON keys (step_views.json_types) as columns (tokens_kept left out, as in JSONL), the
# control-token probabilities as rows in the run header's order under their column's name, the
# token texts last (the columns' order of the files written so far).
PARQUET_NAMES = {"control_token_probs": "control_probs"}
PARQUET_LAST = ("tokens", "token_pieces")
_NOT_IN_FILES = ("tokens_kept",)


def _arrow_type(annotation: Any) -> Any:
    """A field's Parquet type from its JSON type (step_views.json_types): ids int32 and
    per-token numbers float32 (as stored), scalars 64-bit, meta JSON text."""
    import pyarrow as pa

    floats = pa.list_(pa.float32())
    types = {
        "int": pa.int64(),
        "str": pa.string(),
        "float": pa.float64(),
        "bool": pa.bool_(),
        "list[int]": pa.list_(pa.int32()),
        "list[float]": floats,
        "list[str]": pa.list_(pa.string()),
        "dict[str, list[float]]": pa.list_(floats),
        "dict[str, Any]": pa.string(),  # JSON text: meta is free-form
    }
    name = annotation.__name__ if type(annotation) is type else str(annotation)
    return types[name.replace("typing.", "").removesuffix(" | None")]


def rollout_schema() -> Any:
    """The Parquet columns of a rollout, derived from the read view's JSON types (control_probs: one
    row per control token, in the run header's control_tokens order)."""
    import pyarrow as pa

    fields = {name: kind for name, kind in json_types().items() if name not in _NOT_IN_FILES}
    order = [n for n in fields if n not in PARQUET_LAST] + list(PARQUET_LAST)
    return pa.schema([(PARQUET_NAMES.get(n, n), _arrow_type(fields[n])) for n in order])


# Columns files written before them lack (the importer reads them as absent).
OPTIONAL_COLUMNS = frozenset({"token_pieces", "generator_logprobs"})


def _parquet_run(session: Session, run: RunRow) -> Iterator[bytes]:
    """Rollouts as rows, a row group per ROW_GROUP rollouts; the run header and the step records
    (JSON lines) in the file's key-value metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = list(run.control_tokens)
    texts = store.token_texts(session, run_id=run.id)
    steps = "".join(
        dumps(step_record(step, metrics)) + "\n"
        for step, metrics in store.iter_steps(session, run_id=run.id, page=STEP_PAGE)
    )
    header = {META_RUN: storable(dumps(run_record(run))), META_STEPS: storable(steps)}
    schema = rollout_schema().with_metadata(header)
    sink = _Drain()
    writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), schema)
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    try:
        for rollout, prompt in store.iter_rollouts(session, run_id=run.id, batch=ROW_GROUP):
            # the API's shape, with the control-token probabilities as rows in header order
            row: dict[str, Any] = dict(rollout_dict(rollout, prompt, tokens, texts))
            del row["tokens_kept"]
            by_token = row.pop("control_token_probs")
            row["control_probs"] = [by_token[t] for t in tokens]
            row["meta"] = json.dumps(row["meta"], ensure_ascii=False)
            for name, value in row.items():
                # text stored before textsafe cleaned writes may hold a lone surrogate, which
                # Arrow's UTF-8 refuses: U+FFFD, as the pages show it (the same str when clean)
                columns[name].append(storable(value) if isinstance(value, str) else value)
            if len(columns["run_id"]) >= ROW_GROUP:
                writer.write_table(pa.table(columns, schema=schema))
                columns = {name: [] for name in schema.names}
                yield sink.take()
        if columns["run_id"]:
            writer.write_table(pa.table(columns, schema=schema))
    finally:
        writer.close()
    yield sink.take()


# --- the per-step series alone ------------------------------------------------------------------


def _step_columns(session: Session, run: RunRow) -> tuple[list[str], dict[str, str]]:
    """Column names (step, rollout_step, recorded_at, the step columns, then each generic series)
    and generic series name → its column (prefixed `metrics/` only if a step column has it)."""
    fixed = ["step", "rollout_step", "recorded_at", *STEP_SERIES]
    renamed = {
        name: f"metrics/{name}" if name in fixed else name
        for name in store.metric_names(session, run_id=run.id)
    }
    return fixed + list(renamed.values()), renamed


def _step_rows(session: Session, run: RunRow, renamed: dict[str, str]) -> Iterator[dict[str, Any]]:
    for step, metrics in store.iter_steps(session, run_id=run.id, page=STEP_PAGE):
        row: dict[str, Any] = {
            "step": step.step,
            "rollout_step": step.rollout_step,
            "recorded_at": step.recorded_at,
        }
        row.update({name: getattr(step, name) for name in STEP_SERIES})
        row.update({renamed[name]: value for name, value in metrics.items()})
        yield row


def _steps_chunks(session: Session, run: RunRow, fmt: str) -> Iterator[bytes]:
    columns, renamed = _step_columns(session, run)
    rows = _step_rows(session, run, renamed)
    if fmt == "parquet":
        return _steps_parquet(columns, rows)
    if fmt == "csv":
        return _text_chunks(_steps_csv(columns, rows))
    return _text_chunks(
        dumps({c: iso(v) if isinstance(v, datetime) else v for c, v in row.items()}) + "\n"
        for row in rows
    )


def _steps_csv(columns: list[str], rows: Iterator[dict[str, Any]]) -> Iterator[str]:
    """The CSV text; every cell through textsafe.csv_cell (a metric named `=HYPERLINK(…)` is
    text in a spreadsheet, not a formula)."""
    buffer = io.StringIO()
    # RFC 4180's CRLF: the csv module then quotes a cell holding a CR too, not only an LF
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow([csv_cell(c) for c in columns])
    for row in rows:
        writer.writerow(
            [
                csv_cell(iso(v) if isinstance(v, datetime) else ("" if v is None else v))
                for v in (row.get(c) for c in columns)
            ]
        )
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
    yield buffer.getvalue()


def _steps_parquet(columns: list[str], rows: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {
        "step": pa.int64(),
        "rollout_step": pa.int64(),
        "recorded_at": pa.timestamp("us", "UTC"),
    }
    schema = pa.schema([(c, types.get(c, pa.float64())) for c in columns])
    sink = _Drain()
    writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), schema)
    batch: dict[str, list[Any]] = {c: [] for c in columns}
    try:
        for row in rows:
            row["recorded_at"] = _utc(row["recorded_at"])
            for c in columns:
                batch[c].append(row.get(c))
            if len(batch["step"]) >= ROW_GROUP:
                writer.write_table(pa.table(batch, schema=schema))
                batch = {c: [] for c in columns}
                yield sink.take()
        if batch["step"]:
            writer.write_table(pa.table(batch, schema=schema))
    finally:
        writer.close()
    yield sink.take()


def _utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
