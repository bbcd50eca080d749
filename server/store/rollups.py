"""Per-bucket aggregates of every series (count, sum, min, max, first and last step), so a long
run's chart reads a few hundred rows whatever its length.

A bucket of `width` steps is rolled up once, when a step lands beyond its end (server.store
.recording); until then it is the open bucket, aggregated from its steps when read. Each row
packs six float64 numbers per series in all_names order: n, total, lo, hi, first, last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rollout_lens.server.store.layout import STEP_COLUMNS, all_names, row_values
from rollout_lens.server.store.models import ROLLUP_WIDTHS, RollupRow, RunRow, StepRow
from rollout_lens.server.store.packing import pack_doubles, unpack_doubles
from sqlalchemy import Connection, delete, func, insert, select
from sqlalchemy.orm import Session

FIELDS = 6  # n, total, lo, hi, first step, last step
Bucket = tuple[int, int, int, float, float, float]  # first, last, n, mean, lo, hi


def aggregate(rows: Iterable[tuple[int, Sequence[float | None]]], n_names: int) -> list[float]:
    """(step, values in all_names order) rows → FIELDS numbers per name (n = 0 where absent)."""
    out = [0.0] * (FIELDS * n_names)
    for step, values in rows:
        for i, value in enumerate(values):
            if value is None:
                continue
            at = FIELDS * i
            if out[at] == 0:
                out[at : at + FIELDS] = [1.0, value, value, value, step, step]
                continue
            out[at] += 1
            out[at + 1] += value
            out[at + 2] = min(out[at + 2], value)
            out[at + 3] = max(out[at + 3], value)
            out[at + 5] = step
    return out


def step_rows(
    conn: Connection | Session, *, run_id: int, after: int, through: int | None, n_series: int
) -> list[tuple[int, list[float | None]]]:
    """(step, values in all_names order) of steps in (after, through]."""
    query = select(StepRow.step, *STEP_COLUMNS, StepRow.series).where(
        StepRow.run_id == run_id, StepRow.step > after
    )
    if through is not None:
        query = query.where(StepRow.step <= through)
    return [
        (row[0], row_values(row, n_series)) for row in conn.execute(query.order_by(StepRow.step))
    ]


def roll(
    conn: Connection, *, run_id: int, width: int, first: int, last: int, n_series: int
) -> None:
    """Write the rollups of buckets first..last of `width` (those that hold steps): the smallest
    width from its steps, each wider one by merging the next smaller width's rows (rolled
    first), so no roll reads more than ten rows per bucket."""
    n_names = len(all_names([""] * n_series))  # the step columns and the generic series
    smaller = max((w for w in ROLLUP_WIDTHS if w < width and width % w == 0), default=None)
    by_bucket: dict[int, list[float]] = {}
    if smaller is None:
        rows = step_rows(
            conn, run_id=run_id, after=first * width, through=(last + 1) * width, n_series=n_series
        )
        members: dict[int, list[tuple[int, list[float | None]]]] = {}
        for step, values in rows:
            members.setdefault((step - 1) // width, []).append((step, values))
        by_bucket = {b: aggregate(m, n_names) for b, m in members.items()}
    else:
        ratio = width // smaller
        parts = conn.execute(
            select(RollupRow.bucket, RollupRow.data).where(
                RollupRow.run_id == run_id,
                RollupRow.width == smaller,
                RollupRow.bucket >= first * ratio,
                RollupRow.bucket < (last + 1) * ratio,
            )
        )
        for bucket, data in parts:
            merged = by_bucket.setdefault(bucket // ratio, [0.0] * (FIELDS * n_names))
            merge(merged, unpack_doubles(data))
    if by_bucket:
        conn.execute(
            insert(RollupRow),
            [
                {"run_id": run_id, "width": width, "bucket": b, "data": pack_doubles(flat)}
                for b, flat in sorted(by_bucket.items())
            ],
        )


def merge(into: list[float], part: Sequence[float]) -> None:
    """Fold one bucket's aggregates into a wider bucket's (part may know fewer series)."""
    for at in range(0, min(len(into), len(part)), FIELDS):
        n = part[at]
        if n == 0:
            continue
        if into[at] == 0:
            into[at : at + FIELDS] = part[at : at + FIELDS]
            continue
        into[at] += n
        into[at + 1] += part[at + 1]
        into[at + 2] = min(into[at + 2], part[at + 2])
        into[at + 3] = max(into[at + 3], part[at + 3])
        into[at + 4] = min(into[at + 4], part[at + 4])
        into[at + 5] = max(into[at + 5], part[at + 5])


class OpenBuckets:
    """The unfinished bucket of each width, aggregated in memory as the recorder writes steps;
    a bucket's row is written in the transaction of the first step past its end. Loaded from the
    steps not yet rolled up (at most a bucket of each width) when a recorder starts."""

    def __init__(self, conn: Connection, *, run_id: int, n_series: int) -> None:
        self.run_id = run_id
        self.open: dict[int, tuple[int, list[float]]] = {}
        rolled = _rolled_through(conn, run_id=run_id)
        ends = {width: (rolled[width] + 1) * width for width in ROLLUP_WIDTHS}
        rows = step_rows(
            conn, run_id=run_id, after=min(ends.values()), through=None, n_series=n_series
        )
        n_names = len(all_names([""] * n_series))
        for width in ROLLUP_WIDTHS:
            members: dict[int, list[tuple[int, list[float | None]]]] = {}
            for step, values in rows:
                if step > ends[width]:
                    members.setdefault((step - 1) // width, []).append((step, values))
            buckets = sorted(members)
            for bucket in buckets[:-1]:  # finished but never written (not expected; repaired)
                self._write(conn, width, bucket, aggregate(members[bucket], n_names))
            if buckets:
                self.open[width] = (buckets[-1], aggregate(members[buckets[-1]], n_names))

    def add(self, conn: Connection, step: int, values: Sequence[float | None]) -> None:
        """Fold one step's values (all_names order) in; write the buckets it finishes."""
        present = [(FIELDS * i, v) for i, v in enumerate(values) if v is not None]
        size = FIELDS * len(values)
        for width in ROLLUP_WIDTHS:
            bucket = (step - 1) // width
            current = self.open.get(width)
            if current is not None and current[0] != bucket:
                if bucket < current[0]:  # the Recorder refuses such a step before this
                    raise ValueError(f"step {step} comes after a later step: steps must rise")
                self._write(conn, width, *current)
                current = None
            if current is None:
                current = (bucket, [0.0] * size)
                self.open[width] = current
            flat = current[1]
            if len(flat) < size:  # new series appeared
                flat.extend([0.0] * (size - len(flat)))
            for at, v in present:
                if flat[at] == 0:
                    flat[at : at + FIELDS] = [1.0, v, v, v, step, step]
                    continue
                flat[at] += 1
                flat[at + 1] += v
                if v < flat[at + 2]:
                    flat[at + 2] = v
                if v > flat[at + 3]:
                    flat[at + 3] = v
                flat[at + 5] = step

    def _write(self, conn: Connection, width: int, bucket: int, flat: list[float]) -> None:
        conn.execute(
            insert(RollupRow),
            {"run_id": self.run_id, "width": width, "bucket": bucket, "data": pack_doubles(flat)},
        )


def _rolled_through(conn: Connection | Session, *, run_id: int) -> dict[int, int]:
    """Width → the last bucket index rolled up (-1 when none)."""
    found = dict(
        conn.execute(
            select(RollupRow.width, func.max(RollupRow.bucket))
            .where(RollupRow.run_id == run_id)
            .group_by(RollupRow.width)
        ).all()
    )
    return {width: int(found.get(width, -1)) for width in ROLLUP_WIDTHS}


def forget_after(conn: Connection | Session, *, run_id: int, step: int) -> None:
    """Drop the rollups of buckets holding `step` or later steps (a resume truncates those): a
    bucket is rolled up when a step past its end lands, so the one that ends at `step` is open
    again, as it is in a run that never went past `step`."""
    for width in ROLLUP_WIDTHS:
        conn.execute(
            delete(RollupRow).where(
                RollupRow.run_id == run_id,
                RollupRow.width == width,
                RollupRow.bucket >= (step - 1) // width,
            )
        )


def _buckets(flat: Sequence[float], index: int) -> Bucket | None:
    at = FIELDS * index
    if at + FIELDS > len(flat) or flat[at] == 0:
        return None
    n, total, lo, hi, first, last = flat[at : at + FIELDS]
    return int(first), int(last), int(n), total / n, lo, hi


def rollup_series(
    session: Session, *, run_id: int, names: Sequence[str], width: int, since: int = 0
) -> dict[str, list[Bucket]]:
    """Buckets of `width` steps: name → [(first_step, last_step, n, mean, lo, hi)] by step.

    Buckets that end after `since` are returned whole (the open bucket too, read from its
    steps), so a live chart can replace the bucket it last drew.
    """
    series_names = session.scalar(select(RunRow.series_names).where(RunRow.id == run_id)) or []
    layout = all_names(series_names)
    position = {name: i for i, name in enumerate(layout)}  # one pass, not .index() per name
    wanted = [(name, position[name]) for name in names if name in position]
    out: dict[str, list[Bucket]] = {}
    if not wanted:
        return out
    rows = session.execute(
        select(RollupRow.bucket, RollupRow.data)
        .where(
            RollupRow.run_id == run_id, RollupRow.width == width, RollupRow.bucket >= since // width
        )
        .order_by(RollupRow.bucket)
    ).all()
    flats = [(bucket, unpack_doubles(data)) for bucket, data in rows]
    last_rolled = rows[-1][0] if rows else _rolled_through(session, run_id=run_id)[width]
    flats += sorted(
        _tail(
            session, run_id=run_id, width=width, after=(last_rolled + 1) * width, size=len(layout)
        ).items()
    )
    for _, flat in flats:
        for name, index in wanted:
            bucket = _buckets(flat, index)
            if bucket is not None and bucket[1] > since:
                out.setdefault(name, []).append(bucket)
    return out


def _tail(
    session: Session, *, run_id: int, width: int, after: int, size: int
) -> dict[int, list[float]]:
    """Aggregates by bucket of `width` of the steps after `after` (not rolled up at this width):
    the rolled rows of the widest width that divides it where they reach, then the steps."""
    smaller = max((w for w in ROLLUP_WIDTHS if w < width and width % w == 0), default=None)
    out: dict[int, list[float]] = {}
    n_series = size - len(all_names([]))
    if smaller is not None:
        rows = session.execute(
            select(RollupRow.bucket, RollupRow.data)
            .where(
                RollupRow.run_id == run_id,
                RollupRow.width == smaller,
                RollupRow.bucket >= after // smaller,
            )
            .order_by(RollupRow.bucket)
        )
        for bucket, data in rows:
            merge(
                out.setdefault(bucket * smaller // width, [0.0] * (FIELDS * size)),
                unpack_doubles(data),
            )
            after = (bucket + 1) * smaller
    members: dict[int, list[tuple[int, list[float | None]]]] = {}
    for step, values in step_rows(
        session, run_id=run_id, after=after, through=None, n_series=n_series
    ):
        members.setdefault((step - 1) // width, []).append((step, values))
    for bucket, steps in members.items():
        merge(out.setdefault(bucket, [0.0] * (FIELDS * size)), aggregate(steps, size))
    return out


def latest_value(session: Session, *, run_id: int, name: str) -> tuple[int, float] | None:
    """The last recorded (step, value) of a series, in a handful of rows however long the run:
    the open tail's steps, then the newest rolled bucket that has it (its `last` field names the
    step), searching each width over the steps that no wider rollup covers yet."""
    series_names = session.scalar(select(RunRow.series_names).where(RunRow.id == run_id)) or []
    layout = all_names(series_names)
    if name not in layout:
        return None
    index, n_series = layout.index(name), len(series_names)
    rolled = _rolled_through(session, run_id=run_id)
    ends = {width: (rolled[width] + 1) * width for width in ROLLUP_WIDTHS}  # steps rolled up
    tail = step_rows(
        session, run_id=run_id, after=ends[min(ROLLUP_WIDTHS)], through=None, n_series=n_series
    )
    found = _last_in(tail, index)
    if found is not None:
        return found
    widths = sorted(ROLLUP_WIDTHS)
    for width, wider in zip(widths, [*widths[1:], None], strict=True):
        floor = ends[wider] if wider is not None else 0  # below this, a wider rollup answers
        rows = session.execute(
            select(RollupRow.data)
            .where(
                RollupRow.run_id == run_id,
                RollupRow.width == width,
                RollupRow.bucket * width >= floor,
            )
            .order_by(RollupRow.bucket.desc())
        )
        for (data,) in rows:
            bucket = _buckets(unpack_doubles(data), index)
            if bucket is not None:
                last = bucket[1]
                return _last_in(
                    step_rows(
                        session, run_id=run_id, after=last - 1, through=last, n_series=n_series
                    ),
                    index,
                )
    return None


def _last_in(
    rows: Sequence[tuple[int, Sequence[float | None]]], index: int
) -> tuple[int, float] | None:
    for step, values in reversed(rows):
        value = values[index]
        if value is not None:
            return step, float(value)
    return None
