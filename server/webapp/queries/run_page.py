"""The run page's reads: chart series (rollups for a long history), 25-step buckets and
alerts (as the recorder wrote them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core import alerts as rules
from rollout_lens.server.core import vocab
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store import layout, rollups
from rollout_lens.server.store.models import (
    CHART_WIDTHS,
    AlertRow,
    RunRow,
    StepRow,
)
from rollout_lens.server.store.serialize import run_dict
from rollout_lens.server.webapp.queries import chart_data
from rollout_lens.server.webapp.queries.chart_data import expected_series
from rollout_lens.server.webapp.queries.runs import series_names
from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

# --- chart series -------------------------------------------------------------------------------


def known_series(session: Session, *, run_id: int) -> list[str]:
    """The series a run can be asked for: those it recorded and those its launch config promises
    before their first point (evaluation every E steps, SFT phases)."""
    run = store.get_run(session, run_id=run_id)
    names = series_names(session, run_id=run_id)
    return names + [n for n in expected_series(run.config) if n not in names]


def _step_filter(column: Any, since: int, until: int | None) -> list[ColumnElement[bool]]:
    where = [column > since]
    if until is not None:
        where.append(column <= until)
    return where


def series(
    session: Session,
    *,
    run_id: int,
    names: Sequence[str] | None = None,
    since: int = 0,
    until: int | None = None,
    max_points: int | None = chart_data.MAX_POINTS,
) -> dict[str, Any]:
    """Chart series of a run for steps in (since, until], downsampled to ≤ max_points per series.

    `max_points=None` returns every step. See chart_data.DOWNSAMPLING for the method.
    """
    run = store.get_run(session, run_id=run_id)
    if names is None:
        names = series_names(session, run_id=run_id)
    columns = [n for n in names if n in STEP_SERIES]
    metrics = [n for n in names if n not in STEP_SERIES]
    in_range = [StepRow.run_id == run_id, *_step_filter(StepRow.step, since, until)]
    lo, hi = session.execute(
        select(
            select(func.min(StepRow.step)).where(*in_range).scalar_subquery(),
            select(func.max(StepRow.step)).where(*in_range).scalar_subquery(),
        )
    ).one()
    width = 1 if lo is None or hi is None else chart_data.bucket_width(hi - lo + 1, max_points)
    out: dict[str, dict[str, list[Any]]] = {}
    rollup = next((w for w in CHART_WIDTHS if w >= width), None) if width > 1 else None
    if rollup is not None and since == 0 and until is None:
        # A long run's whole history: read the buckets the writer keeps, not every step.
        width = rollup
        rows = store.rollup_series(session, run_id=run_id, names=names, width=width)
        out.update(chart_data.rollup_series(rows))
    else:
        if columns and lo is not None:
            out.update(_column_series(session, run_id, columns, since, until, width))
        if metrics:
            out.update(_metric_series(session, run_id, metrics, since, until, width))
    buckets = bucket_means(session, run_id=run_id, since=since, until=until)
    return {
        "run_id": run_id,
        "run": chart_data.run_progress(run_dict(run)),
        "since": since,
        "until": until,
        "cursor": hi if hi is not None else since,
        "bucket": width,
        "method": chart_data.DOWNSAMPLING,
        "series": {name: out[name] for name in names if name in out},
        "buckets": buckets,
    }


def _column_series(
    session: Session, run_id: int, names: list[str], since: int, until: int | None, width: int
) -> dict[str, dict[str, list[Any]]]:
    cols = [getattr(StepRow, n) for n in names]
    where = [StepRow.run_id == run_id, *_step_filter(StepRow.step, since, until)]
    if width == 1:
        rows = session.execute(
            select(StepRow.step, *cols).where(*where).order_by(StepRow.step)
        ).all()
        return chart_data.raw_series(names, rows)
    bucket = ((StepRow.step - 1) // width).label("bucket")
    aggs = [agg(c) for c in cols for agg in (func.avg, func.min, func.max)]
    query = select(func.min(StepRow.step), *aggs).where(*where).group_by(bucket).order_by(bucket)
    return chart_data.bucketed_series(names, session.execute(query).all())


def _metric_series(
    session: Session, run_id: int, names: list[str], since: int, until: int | None, width: int
) -> dict[str, dict[str, list[Any]]]:
    """Generic series from each step's packed values; buckets of `width` steps aggregated here
    (the whole-history chart of a long run reads rollups instead)."""
    layout_names = store.series_names(session, run_id=run_id)
    position = {name: i for i, name in enumerate(layout_names)}  # one pass, not .index() per name
    wanted = [(n, position[n]) for n in names if n in position]
    if not wanted:
        return {}
    query = select(StepRow.step, StepRow.series).where(
        StepRow.run_id == run_id, *_step_filter(StepRow.step, since, until)
    )
    points: dict[str, list[tuple[int, float]]] = {}
    for step, data in session.execute(query.order_by(StepRow.step)):
        values = layout.decode(data, len(layout_names))
        for name, index in wanted:
            if (value := values[index]) is not None:
                points.setdefault(name, []).append((step, value))
    out: dict[str, dict[str, list[Any]]] = {}
    for name, pts in points.items():
        if width == 1:
            out[name] = {"x": [s for s, _ in pts], "y": [v for _, v in pts]}
            continue
        entry: dict[str, list[Any]] = {"x": [], "y": [], "lo": [], "hi": []}
        buckets: dict[int, list[tuple[int, float]]] = {}
        for step, value in pts:
            buckets.setdefault((step - 1) // width, []).append((step, value))
        for members in buckets.values():
            vals = [v for _, v in members]
            entry["x"].append(members[0][0])
            entry["y"].append(sum(vals) / len(vals))
            entry["lo"].append(min(vals))
            entry["hi"].append(max(vals))
        out[name] = entry
    return out


def bucket_means(
    session: Session, *, run_id: int, since: int = 0, until: int | None = None
) -> dict[str, list[Any]]:
    """25-step bucket means (steps 1–25, 26–50, …) of every bucket touched by steps after `since`.

    A live page polls with its cursor and replaces the buckets it gets back by their index. Read
    from the 25-step rollups (a few hundred rows for a long run, however long); `n` is the number
    of steps in the bucket that logged any of the three. With `until`, from the steps.
    """
    width = vocab.WINDOW
    if until is None:
        names = ("true_accuracy", "reward_mean", "format_valid_rate")
        found = store.rollup_series(session, run_id=run_id, names=names, width=width, since=since)
        rows: dict[int, list[Any]] = {}
        for column, name in enumerate(names, start=2):
            for first, _last, n, mean, _lo, _hi in found.get(name, []):
                row = rows.setdefault(
                    (first - 1) // width, [(first - 1) // width, 0, None, None, None]
                )
                row[1] = max(row[1], n)
                row[column] = mean
        return chart_data.bucket_table([rows[b] for b in sorted(rows)])
    bucket = ((StepRow.step - 1) // width).label("bucket")
    start = (since // width) * width  # the whole bucket holding step since+1
    query = (
        select(
            bucket,
            func.count(StepRow.step),
            func.avg(StepRow.true_accuracy),
            func.avg(StepRow.reward_mean),
            func.avg(StepRow.format_valid_rate),
        )
        .where(StepRow.run_id == run_id, *_step_filter(StepRow.step, start, until))
        .group_by(bucket)
        .order_by(bucket)
    )
    return chart_data.bucket_table(session.execute(query).all())


# --- alerts -------------------------------------------------------------------------------------


def alerts(session: Session, *, run_id: int, since: int = 0) -> list[dict[str, Any]]:
    """The run's alerts after `since`: those its recorder wrote with each step (an index seek),
    plus any for steps it did not evaluate (evaluated here from the steps, not stored)."""
    run = store.get_run(session, run_id=run_id)
    found = [
        rules.FiredAlert(kind, step, message, series)
        for kind, step, message, series in session.execute(
            select(AlertRow.kind, AlertRow.step, AlertRow.message, AlertRow.series)
            .where(AlertRow.run_id == run_id, AlertRow.step > since)
            .order_by(AlertRow.step, AlertRow.kind)
        )
    ]
    through = max(run.alerts_through, since)
    if run.current_step > through:
        found += evaluate_alerts(session, run_id=run_id, after=through)
    return [a.as_dict() for a in found]


def evaluate_alerts(session: Session, *, run_id: int, after: int = 0) -> list[rules.FiredAlert]:
    """The alert rules over the recorded steps, keeping the alerts after `after` (the rules read
    rules.CONTEXT steps before it as history). after=0 is the from-scratch evaluation the
    recorder's step-by-step one must equal."""
    names = layout.all_names(store.series_names(session, run_id=run_id))
    rows = rollups.step_rows(
        session,
        run_id=run_id,
        after=max(0, after - rules.CONTEXT),
        through=None,
        n_series=len(names) - len(STEP_SERIES),
    )
    history = [(step, dict(zip(names, values, strict=True))) for step, values in rows]
    thresholds = rules.AlertThresholds().for_run(
        session.scalar(select(RunRow.prompts_per_step).where(RunRow.id == run_id))
    )
    found = rules.evaluate(rules.from_history(history), thresholds)
    return [a for a in found if a.step > after]
