"""Import a file written by `rollout-lens export` (JSONL or Parquet) as a new run.

The file is read as a stream and written step by step inside ONE transaction: a damaged file
(bad line, cut short, wrong counts, a value the database refuses) raises InvalidInput and leaves
nothing behind. The new run has source `import`; a run exported while queued or running is
imported as `lost` (nothing records the copy).

What is held at once is bounded: a JSONL line, a Parquet batch of rows, the rollouts batched for
one write (BATCH_BYTES). A file sent over HTTP (`max_bytes`, its byte cap) is held to
bounds.DECODE_FACTOR × the cap at once: its lines are shorter, and a Parquet file's metadata is
checked before any data is read (each row group's declared size, its columns, and what its pages'
own headers say they decode to: server.exchange.parquet_pages, as the footer may lie), its texts
read as dictionaries and each batch's rows measured before they become Python objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import ControlProbs, RolloutRecord, StepRecord, as_floats
from rollout_lens.server.exchange import bounds, parquet_pages
from rollout_lens.server.exchange.dump_rows import BLANK, SeriesNames, json_line
from rollout_lens.server.exchange.schema import (
    FORMAT,
    META_RUN,
    META_STEPS,
    RECORDS,
    RUN_AFTER_STEPS,
    VERSION,
    EndLine,
    RolloutLine,
    RunRecord,
    StepLine,
    validation_text,
)
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import ACTIVE_STATUSES, RunSource, RunStatus
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

BATCH = 500  # rollouts written per statement
BATCH_TOKENS = 2**20  # ... or fewer: the batch holds at most about this many tokens' arrays
BATCH_BYTES = 32 * 2**20  # ... and about this many bytes of texts and arrays
NAME_CHARS = 200  # the runs table's name column
PARQUET_MAGIC = b"PAR1"


@dataclass
class Imported:
    """What an import created."""

    run_id: int
    name: str
    steps: int
    rollouts: int


def import_export(
    factory: sessionmaker[Session],
    path: Path,
    *,
    name: str | None = None,
    moved: bool = False,
    max_bytes: int | None = None,
) -> Imported:
    """Create a run from an export file; InvalidInput (and nothing created) if it is damaged.
    `moved`: the file carries a run made elsewhere for this database (the CLI's `import-trl
    --url` imports the dumps on its own machine and sends the export): it keeps its source
    (TRL's or verl's import) and gains no note. `max_bytes`: the byte cap of the request that
    sent it (its decoding is bounded by it); None for a file of this machine."""
    if not path.is_file():
        raise InvalidInput(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    parquet = magic == PARQUET_MAGIC
    most = None if max_bytes is None else bounds.DECODE_FACTOR * max_bytes
    records = (
        _parquet_records(path, most)
        if parquet
        else _jsonl_records(path, bounds.line_limit(max_bytes))
    )
    try:
        with session_scope(factory) as session:
            # Parquet needs no end record: a file cut short has no footer and does not open.
            return _write(session, records, name=name, needs_end=not parquet, moved=moved)
    except InvalidInput as exc:
        raise InvalidInput(f"{path}: {exc}") from exc
    except (IntegrityError, DataError) as exc:
        raise InvalidInput(f"{path}: the database refused a value: {exc.orig}") from exc


def _write(
    session: Session,
    records: Iterator[tuple[str, Any]],
    *,
    name: str | None,
    needs_end: bool,
    moved: bool = False,
) -> Imported:
    first = next(records, None)
    if first is None:
        raise InvalidInput("empty file, not a rollout-lens export")
    where, header = first
    if not isinstance(header, RunRecord):
        raise InvalidInput(
            f"not a rollout-lens export: {where} is not the run header (a `--what steps` "
            "export cannot be imported; TRL's completions files go through `import-trl`)"
        )
    if header.format != FORMAT:
        raise InvalidInput(f"{where}: not a rollout-lens export (format {header.format!r})")
    if header.version > VERSION:
        raise InvalidInput(
            f"{where}: written by a newer rollout-lens (format version {header.version}); "
            f"this one reads version {VERSION}"
        )
    try:
        writer = _ImportedRun(session, header, name=name, moved=moved)
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: {exc}") from exc
    end: EndLine | None = None
    for where, record in records:
        if end is not None:
            raise InvalidInput(f"{where}: a record after the end record")
        try:
            if isinstance(record, StepLine):
                writer.step(record)
            elif isinstance(record, RolloutLine):
                writer.rollout(record)
            elif isinstance(record, EndLine):
                end = record
            else:
                raise InvalidInput("a second run header")
        except InvalidInput as exc:
            raise InvalidInput(f"{where}: {exc}") from exc
    writer.finish()
    if needs_end and end is None:
        raise InvalidInput("the file ends before its end record (cut short?)")
    if end is not None and (end.steps, end.rollouts) != (writer.steps, writer.rollouts):
        raise InvalidInput(
            f"the end record counts {end.steps} steps and {end.rollouts} rollouts, the "
            f"file holds {writer.steps} and {writer.rollouts}"
        )
    return Imported(writer.run_id, writer.name, writer.steps, writer.rollouts)


class _ImportedRun:
    """Writes a run's records as they arrive: steps at once, rollouts in batches."""

    def __init__(
        self, session: Session, header: RunRecord, *, name: str | None, moved: bool = False
    ) -> None:
        self.session = session
        self.header = header
        self.tokens = list(header.control_tokens)
        self.name = name or header.name
        if len(self.name) > NAME_CHARS:
            raise InvalidInput(f"--name: at most {NAME_CHARS} characters, got {len(self.name)}")
        status, error, self.ended_by = header.status, header.error, header.ended_by
        if status in ACTIVE_STATUSES:
            # Nothing records the copy: lost, like a run whose worker stopped.
            status = RunStatus.lost.value
            error = error or (
                f"exported while {header.status} at step {header.current_step}; "
                "this copy ends there"
            )
            self.ended_by = None  # no one ended it: it stopped at the export
        self.error = error
        notes = list(header.notes)
        source = RunSource.import_
        if moved and header.source in (
            RunSource.trl_import,
            RunSource.verl_import,
            RunSource.nemo_rl_import,
            RunSource.slime_import,
        ):
            source = RunSource(header.source)
        elif header.source != RunSource.import_:  # a copy of a copy keeps the first note
            notes.append(
                f"imported from a rollout-lens export of run {header.id} (source {header.source})"
            )
        run = store.create_run(
            session,
            name=self.name,
            model=header.model,
            total_steps=header.total_steps,
            group_size=header.group_size,
            prompts_per_step=header.prompts_per_step,
            seed=header.seed,
            variant=header.variant,
            k=header.k,
            config=header.config,
            control_tokens=self.tokens,
            status=RunStatus(status),
            source=source,
            notes=notes,
        )
        self.run_id = run.id
        self.steps = 0
        self.rollouts = 0
        self._last_step: int | None = None
        self._last_rollout: tuple[int, int, int] | None = None
        self._batch: list[RolloutRecord] = []
        self._batch_tokens = 0
        self._batch_bytes = 0
        self._batch_step = 0
        self._writer = store.RunWriter(self.run_id, control_tokens=self.tokens)
        self._series = SeriesNames()

    def step(self, line: StepLine) -> None:
        if self._last_step is not None and line.step <= self._last_step:
            raise InvalidInput(f"step {line.step} after step {self._last_step} (steps must rise)")
        self._last_step = line.step
        self._series.add(line.metrics)
        self.steps += 1
        record = StepRecord(
            step=line.step,
            rollout_step=line.rollout_step,
            values=line.values(),
            metrics=line.metrics,
            recorded_at=_utc(line.recorded_at),
        )
        self._writer.write(self.session, [record])

    def rollout(self, line: RolloutLine) -> None:
        key = (line.step, line.group, line.index)
        if self._last_rollout is not None and key <= self._last_rollout:
            raise InvalidInput(
                f"rollout (step, group, index) {key} after {self._last_rollout} (repeated or "
                "out of order)"
            )
        self._last_rollout = key
        if sorted(line.control_token_probs) != sorted(self.tokens):
            raise InvalidInput(
                f"control_token_probs has {sorted(line.control_token_probs)}, the run's control "
                f"tokens are {sorted(self.tokens)}"
            )
        if len({len(row) for row in line.control_token_probs.values()}) > 1:
            raise InvalidInput("control_token_probs rows differ in length")
        if self._batch and self._batch_step != line.step:
            self._flush()
        self._batch_step = line.step
        self._batch.append(
            RolloutRecord(
                group=line.group,
                index=line.index,
                prompt=line.prompt,
                completion=line.completion,
                completion_ids=np.asarray(line.completion_ids, dtype=np.int64),
                token_logprobs=as_floats(line.token_logprobs),
                generator_logprobs=(
                    None if line.generator_logprobs is None else as_floats(line.generator_logprobs)
                ),
                control_probs=ControlProbs.of(line.control_token_probs, len(line.completion_ids)),
                vote=line.vote,
                target=line.target,
                verifier_reward=line.verifier_reward,
                true_score=line.true_score,
                advantage=line.advantage,
                format_valid=line.format_valid,
                format_state=line.format_state,
                meta=line.meta,
                tokens=line.stored_pieces(),
                # the stored sum (None: unknown, NaN; never re-summed from float16 logprobs)
                given_sum_logprob=math.nan if line.sum_logprob is None else line.sum_logprob,
            )
        )
        self.rollouts += 1
        self._batch_tokens += len(line.completion_ids)
        self._batch_bytes += _held_bytes(line, len(self.tokens))
        if (
            len(self._batch) >= BATCH
            or self._batch_tokens >= BATCH_TOKENS
            or self._batch_bytes >= BATCH_BYTES
        ):
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._writer.add_rollouts(self.session, step=self._batch_step, rollouts=self._batch)
            self._batch = []
            self._batch_tokens = 0
            self._batch_bytes = 0

    def finish(self) -> None:
        """Write what is batched, then the run columns as exported."""
        self._flush()
        values = {name: getattr(self.header, name) for name in RUN_AFTER_STEPS}
        values["error"] = self.error
        values["ended_by"] = self.ended_by
        for name, value in values.items():
            if isinstance(value, datetime):
                values[name] = _utc(value)
        store.restore_run_columns(self.session, run_id=self.run_id, values=values)


def _held_bytes(line: RolloutLine, k: int) -> int:
    """About what a batched rollout holds: its texts, and per token its id, logprobs (both
    sides), control probabilities and piece (8 bytes each)."""
    texts = (line.prompt, line.completion, line.vote, line.target, line.format_state)
    return sum(len(t) for t in texts if t) + 8 * (4 + k) * len(line.completion_ids)


def _utc(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)


# --- reading the two formats --------------------------------------------------------------------


def _parse(where: str, data: Any) -> Any:
    """A decoded record → its model, or InvalidInput naming where and what."""
    if not isinstance(data, dict) or data.get("kind") not in RECORDS:
        raise InvalidInput(f"{where}: not a record (needs a kind: run, step, rollout or end)")
    try:
        return RECORDS[data["kind"]].model_validate(data)
    except ValidationError as exc:
        raise InvalidInput(
            f"{where}: invalid {data['kind']} record: {validation_text(exc)}"
        ) from exc


def _jsonl_records(path: Path, most: int) -> Iterator[tuple[str, Any]]:
    """(where, record) for each line of a JSONL export, read and validated one line at a time
    (at most `most` bytes of it in memory)."""
    with path.open("rb") as f:
        for number, raw in bounds.lines(f, "", most=most):
            where = f"line {number}"
            data = json_line(raw, where)
            if data is not BLANK:
                yield where, _parse(where, data)


def _parquet_records(path: Path, most: int | None) -> Iterator[tuple[str, Any]]:
    """(where, record): the run and steps from the metadata, then each rollout row. `most`:
    the bytes it may decode at once (None: unbounded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rollout_lens.server.exchange.export import rollout_schema

    try:
        with pq.ParquetFile(path) as parquet:
            # texts stay dictionaries as they are read: a text repeated in a column is held once
            # until a batch's rows are measured (read_dictionary names them by leaf path)
            texts = [c.path for c in parquet.schema if c.physical_type == "BYTE_ARRAY"]
            if most is not None:
                names = set(rollout_schema().names)
                _check_parquet(parquet.metadata, names, most)
                parquet_pages.check_pages(
                    path, parquet.metadata, names, most, where=_HELD_OVER_HTTP
                )
        parquet = pq.ParquetFile(path, read_dictionary=texts)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidInput(f"not a readable Parquet file ({exc})") from exc
    with parquet:
        yield from _parquet_rows(parquet, most)


MAX_PARQUET_COLUMNS = 64  # leaf columns of an imported Parquet file (an export has 21)
_HELD_OVER_HTTP = (
    f"an import over HTTP may hold at once ({bounds.DECODE_FACTOR} × ROLLOUT_LENS_RECORD_MAX_MB)"
)


def _check_parquet(metadata: Any, names: set[str], most: int) -> None:
    """Refuse, from its metadata alone, a file of more columns than an export has room for or a
    row group whose columns say they decode to more than `most` bytes."""
    if metadata.num_columns > MAX_PARQUET_COLUMNS:
        raise InvalidInput(
            f"{metadata.num_columns} columns: more than the {MAX_PARQUET_COLUMNS} an export has"
        )
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        size = sum(
            group.column(j).total_uncompressed_size
            for j in range(group.num_columns)
            if group.column(j).path_in_schema.split(".")[0] in names
        )
        if size > most:
            raise InvalidInput(
                f"row group {i + 1}: its columns decode to {size:,} bytes, more than the "
                f"{most:,} an import over HTTP may hold at once ({bounds.DECODE_FACTOR} × "
                "ROLLOUT_LENS_RECORD_MAX_MB)"
            )


def _python_bytes(array: Any) -> Any:
    """Per row, about the bytes of what `to_pylist` makes of it (an array of floats): 64 a
    string or list (and its bytes or items), 32 a number."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(array)
    valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    kind = array.type
    if pa.types.is_dictionary(kind):
        per_value = _python_bytes(array.dictionary)
        indices = pc.fill_null(array.indices, 0).to_numpy(zero_copy_only=False)
        out = per_value[indices] if len(per_value) else np.zeros(n)
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        items = _python_bytes(array.flatten())
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
        out = 64 + 8 * lengths + np.bincount(parents, weights=items, minlength=n)
    elif pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind):
        out = 64 + pc.fill_null(pc.binary_length(array), 0).to_numpy(zero_copy_only=False)
    else:
        out = np.full(n, 32.0)
    return np.where(valid, out, 16.0)


def _measured(batch: Any, most: int | None, first_row: int) -> Iterator[Any]:
    """A batch cut into runs of rows whose Python objects are at most `most` bytes (a meta's
    JSON counted at bounds.JSON_BYTES a byte); a row over it alone is refused."""
    if most is None:
        yield batch
        return
    import numpy as np

    cost = np.zeros(batch.num_rows)
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        cost += _python_bytes(column) * (bounds.JSON_BYTES if name == "meta" else 1)
    start, held = 0, 0.0
    for i, size in enumerate(cost.tolist()):
        if size > most:
            raise InvalidInput(
                f"row {first_row + i}: decodes to about {int(size):,} bytes, more than the "
                f"{most:,} an import over HTTP may hold at once ({bounds.DECODE_FACTOR} × "
                "ROLLOUT_LENS_RECORD_MAX_MB)"
            )
        if held + size > most:
            yield batch.slice(start, i - start)
            start, held = i, 0.0
        held += size
    if start < batch.num_rows:
        yield batch.slice(start)


def _parquet_rows(parquet: Any, most: int | None = None) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    from rollout_lens.server.exchange.export import OPTIONAL_COLUMNS, ROW_GROUP, rollout_schema

    meta = parquet.schema_arrow.metadata or {}
    if META_RUN not in meta:
        raise InvalidInput(
            "not a rollout-lens export (no run header in the Parquet metadata; a "
            "`--what steps` export cannot be imported; TRL's completions go through `import-trl`)"
        )
    missing = [
        n
        for n in rollout_schema().names
        if n not in parquet.schema_arrow.names and n not in OPTIONAL_COLUMNS
    ]
    if missing:
        raise InvalidInput(f"the rollouts lack the columns {', '.join(missing)}")
    try:
        header = bounds.loads(meta[META_RUN], "the run header")
        steps = meta.get(META_STEPS, b"").decode("utf-8").splitlines()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the run header in the metadata is not JSON ({exc})") from exc
    yield "the run header", _parse("the run header", header)
    tokens = header.get("control_tokens") or []
    for number, text in enumerate(steps, start=1):
        where = f"step record {number} of the metadata"
        try:
            yield where, _parse(where, bounds.loads(text, where))
        except ValueError as exc:
            raise InvalidInput(f"{where}: not valid JSON ({exc})") from exc
    row_number = 0
    columns = [n for n in rollout_schema().names if n in parquet.schema_arrow.names]
    try:
        batches = parquet.iter_batches(batch_size=ROW_GROUP, columns=columns)
        for rows in (part for b in batches for part in _measured(b, most, row_number + 1)):
            for row in rows.to_pylist():
                row_number += 1
                where = f"row {row_number}"
                probs = row.pop("control_probs") or []
                if len(probs) != len(tokens):
                    raise InvalidInput(
                        f"{where}: {len(probs)} control_probs rows for {len(tokens)} control tokens"
                    )
                try:
                    row["meta"] = bounds.loads(row["meta"], f"{where}: meta")
                except (TypeError, ValueError) as exc:
                    raise InvalidInput(f"{where}: meta is not JSON ({exc})") from exc
                row["control_token_probs"] = dict(zip(tokens, probs, strict=True))
                yield where, _parse(where, {"kind": "rollout"} | row)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a text that is not UTF-8
        raise InvalidInput(f"damaged Parquet data after row {row_number} ({exc})") from exc
