"""All SQL of the dashboard's reads: keyword-only functions over a Session (routes → queries).

Every read here costs the same whatever a run's length (index seeks on (run_id, step)), except
three that read each step of the range they cover: chart series (aggregated in SQL into at most
max_points buckets), alerts and compare's summary. Their full-history answers are cached by
run version in the API (server.cache); a live page asks only for steps after its cursor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from rollout_lens.server import alerts as rules
from rollout_lens.server import charts, store, viewer
from rollout_lens.server import series as vocab
from rollout_lens.server.errors import InvalidInput, NotFound, StepNotFound
from rollout_lens.server.formats import live_text
from rollout_lens.server.models import (
    ACTIVE_STATUSES,
    ROLLUP_WIDTHS,
    AlertRow,
    Prompt,
    Rollout,
    Run,
    RunSource,
    RunStatus,
    Step,
)
from rollout_lens.server.packing import head_ints, unpack_ints
from rollout_lens.server.serialize import rollout_dict, run_dict, step_dict
from rollout_lens.server.series import STEP_SERIES
from rollout_lens.server.store import layout, rollups
from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

# --- runs ---------------------------------------------------------------------------------------

RUN_SORTS: dict[str, Any] = {
    "created": Run.id,
    "name": func.lower(Run.name),
    "status": Run.status,
    "progress": Run.current_step * 1.0 / func.nullif(Run.total_steps, 0),
    "variant": Run.variant,
    "model": func.lower(Run.model),
    "k": Run.k,
    "group_size": Run.group_size,
    "seed": Run.seed,
    "accuracy": Run.recent_true_accuracy,
    "reward": Run.recent_reward,
    "device_minutes": Run.device_seconds,
    "cost": Run.cost,
}


def _like(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _run_filters(q: str, ids: Sequence[int] | None, after: int | None) -> list[ColumnElement[bool]]:
    """Every word of `q` in name, model, variant or status; `ids` or (with both) newer than `after`."""
    where: list[ColumnElement[bool]] = []
    for word in q.split():
        pattern = _like(word)
        columns = (Run.name, Run.model, Run.variant, Run.status)
        where.append(or_(*(col.ilike(pattern, escape="\\") for col in columns)))
    narrow: list[ColumnElement[bool]] = []
    if ids is not None:
        narrow.append(Run.id.in_(ids))
    if after is not None:
        narrow.append(Run.id > after)
    if narrow:
        where.append(or_(*narrow))
    return where


def _run_order(sort: str, descending: bool) -> list[Any]:
    """The sort key, missing values last, then newest first."""
    if sort not in RUN_SORTS:
        raise InvalidInput(f"cannot sort runs by {sort!r}; choose one of {', '.join(RUN_SORTS)}")
    key = RUN_SORTS[sort]
    return [key.is_(None), key.desc() if descending else key.asc(), Run.id.desc()]


def _listed(session: Session, runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Run rows as the runs list shows them: columns, place in the queue, stored warnings (one
    grouped query for them all), live text."""
    out = [run_dict(run) for run in runs]
    places = store.queue_positions(session) if any(r["status"] == "queued" for r in out) else {}
    warnings = warning_counts(session, run_ids=[r["id"] for r in out])
    for run in out:
        run["queue_position"] = places.get(run["id"])
        run["warnings"] = warnings.get(run["id"], 0)
        run["text"] = live_text(run)
    return out


def list_runs(
    session: Session,
    *,
    q: str = "",
    sort: str = "created",
    descending: bool = True,
    ids: Sequence[int] | None = None,
    after: int | None = None,
) -> list[dict[str, Any]]:
    """Every run matching every word of `q` (name, model, variant, status), sorted, missing
    values last; `ids` and `after` narrow as in runs_page. The runs page reads runs_page."""
    query = select(Run).where(*_run_filters(q, ids, after)).order_by(*_run_order(sort, descending))
    return _listed(session, list(session.scalars(query)))


RUNS_PER_PAGE = 50  # rows of the runs page
MAX_RUNS_PER_PAGE = 200


def runs_page(
    session: Session,
    *,
    q: str = "",
    sort: str = "created",
    descending: bool = True,
    page: int = 1,
    per_page: int = RUNS_PER_PAGE,
    ids: Sequence[int] | None = None,
    after: int | None = None,
) -> dict[str, Any]:
    """One page of list_runs' runs, with how many match and the newest matching id.

    Three statements whatever the number of runs (a count with the newest id, the page's rows,
    their stored warnings grouped by run), plus one for queue places when the page holds a
    queued run: the rows are the runs' own columns (summary columns the writer keeps current),
    never a per-run read. Pages are
    offsets into the sorted list; a page past the end is empty (with `pages` saying how many).
    `ids` and `after` narrow the list to those runs or (with both) to those runs plus any run
    newer than `after`: what a live runs page polls for.
    """
    if not 1 <= per_page <= MAX_RUNS_PER_PAGE:
        raise InvalidInput(f"per_page goes from 1 to {MAX_RUNS_PER_PAGE}, got {per_page}")
    if page < 1:
        raise InvalidInput(f"pages are numbered from 1, got {page}")
    where, order = _run_filters(q, ids, after), _run_order(sort, descending)
    total, newest = session.execute(select(func.count(), func.max(Run.id)).where(*where)).one()
    offset = (page - 1) * per_page
    rows = session.scalars(
        select(Run).where(*where).order_by(*order).offset(offset).limit(per_page)
    )
    runs = _listed(session, list(rows))
    return {
        "runs": runs,
        "total": total,
        "page": page,
        "per_page": per_page,
        "pages": max(1, -(-total // per_page)),
        "first": offset + 1 if runs else None,
        "last": offset + len(runs) if runs else None,
        "newest": newest,
    }


def run_card(session: Session, *, run_id: int) -> dict[str, Any]:
    """One run's columns (NotFound if there is none)."""
    return run_dict(store.get_run(session, run_id=run_id))


def _bounds(session: Session, *, run_id: int) -> tuple[int | None, int | None]:
    """First and last recorded step: one statement, two index seeks."""
    first, last = session.execute(
        select(
            select(func.min(Step.step)).where(Step.run_id == run_id).scalar_subquery(),
            select(func.max(Step.step)).where(Step.run_id == run_id).scalar_subquery(),
        )
    ).one()
    return first, last


def series_names(session: Session, *, run_id: int) -> list[str]:
    """The run's series: step columns, then its generic series (one column of the run row)."""
    return [*STEP_SERIES, *sorted(store.series_names(session, run_id=run_id))]


def run_version(session: Session, *, run_id: int) -> str:
    """A token that changes whenever the run's recorded data may have (every step write
    refreshes heartbeat_at and current_step); cached responses are keyed by it."""
    row = session.execute(
        select(Run.created_at, Run.heartbeat_at, Run.current_step, Run.status).where(
            Run.id == run_id
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"run {run_id} does not exist")
    return _version_token(run_id, *row)


def _version_token(run_id: int, created: Any, beat: Any, step: int, status: str) -> str:
    return f"{run_id}:{created.isoformat() if created else ''}:{beat.isoformat() if beat else ''}:{step}:{status}"


def run_overview(session: Session, *, run_id: int) -> dict[str, Any]:
    """A run, its step bounds, the names of its recorded series and its live state (its alerts
    read every step: the routes add them from their cache, see routes.api.run_alerts)."""
    run = store.get_run(session, run_id=run_id)
    first, last = _bounds(session, run_id=run_id)
    return {
        "run": run_dict(run),
        "first_step": first,
        "last_step": last,
        "series_names": series_names(session, run_id=run_id),
        "live": run_live(session, run_id=run_id),
    }


RATE_WINDOW = 10  # recent steps that the steps-per-second figure averages over


def run_live(session: Session, *, run_id: int) -> dict[str, Any]:
    """What a live page shows besides the charts: progress, place in the queue, steps per second
    and ETA, and which of cancel and resume apply. Reads at most RATE_WINDOW step rows."""
    run = store.get_run(session, run_id=run_id)
    out = charts.run_progress(run_dict(run))
    rate = None
    if run.status == RunStatus.running and run.started_at is not None:
        recent = session.execute(
            select(Step.step, Step.recorded_at)
            .where(Step.run_id == run_id, Step.recorded_at >= run.started_at)
            .order_by(Step.step.desc())
            .limit(RATE_WINDOW)
        ).all()
        rate = charts.steps_per_second([(s, t) for s, t in recent])
    remaining = max(run.total_steps - run.current_step, 0)
    live = out | {
        "queue_position": store.queue_position(session, run_id=run_id),
        "steps_per_second": rate,
        "eta_seconds": remaining / rate if rate else None,
        "cancel_requested": bool(run.cancel_requested),
        "checkpoint_step": run.checkpoint_step,
        "can_cancel": run.status in ACTIVE_STATUSES and not run.cancel_requested,
        "can_resume": run.status in store.RESUMABLE_STATUSES and run.source == RunSource.launched,
    }
    return live | {"summary": charts.live_summary(live), "text": live_text(live)}


# --- chart series -------------------------------------------------------------------------------


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
    max_points: int | None = charts.MAX_POINTS,
) -> dict[str, Any]:
    """Chart series of a run for steps in (since, until], downsampled to ≤ max_points per series.

    `max_points=None` returns every step. See charts.DOWNSAMPLING for the method.
    """
    run = store.get_run(session, run_id=run_id)
    if names is None:
        names = series_names(session, run_id=run_id)
    columns = [n for n in names if n in STEP_SERIES]
    metrics = [n for n in names if n not in STEP_SERIES]
    in_range = [Step.run_id == run_id, *_step_filter(Step.step, since, until)]
    lo, hi = session.execute(
        select(
            select(func.min(Step.step)).where(*in_range).scalar_subquery(),
            select(func.max(Step.step)).where(*in_range).scalar_subquery(),
        )
    ).one()
    width = 1 if lo is None or hi is None else charts.bucket_width(hi - lo + 1, max_points)
    out: dict[str, dict[str, list[Any]]] = {}
    rollup = next((w for w in ROLLUP_WIDTHS if w >= width), None) if width > 1 else None
    if rollup is not None and since == 0 and until is None:
        # A long run's whole history: read the buckets the writer keeps, not every step.
        width = rollup
        rows = store.rollup_series(session, run_id=run_id, names=names, width=width)
        out.update(charts.rollup_series(rows))
    else:
        if columns and lo is not None:
            out.update(_column_series(session, run_id, columns, since, until, width))
        if metrics:
            out.update(_metric_series(session, run_id, metrics, since, until, width))
    buckets = bucket_means(session, run_id=run_id, since=since, until=until)
    return {
        "run_id": run_id,
        "run": charts.run_progress(run_dict(run)),
        "since": since,
        "until": until,
        "cursor": hi if hi is not None else since,
        "bucket": width,
        "method": charts.DOWNSAMPLING,
        "series": {name: out[name] for name in names if name in out},
        "buckets": buckets,
    }


def _column_series(
    session: Session, run_id: int, names: list[str], since: int, until: int | None, width: int
) -> dict[str, dict[str, list[Any]]]:
    cols = [getattr(Step, n) for n in names]
    where = [Step.run_id == run_id, *_step_filter(Step.step, since, until)]
    if width == 1:
        rows = session.execute(select(Step.step, *cols).where(*where).order_by(Step.step)).all()
        return charts.raw_series(names, rows)
    bucket = ((Step.step - 1) // width).label("bucket")
    aggs = [agg(c) for c in cols for agg in (func.avg, func.min, func.max)]
    query = select(func.min(Step.step), *aggs).where(*where).group_by(bucket).order_by(bucket)
    return charts.bucketed_series(names, session.execute(query).all())


def _metric_series(
    session: Session, run_id: int, names: list[str], since: int, until: int | None, width: int
) -> dict[str, dict[str, list[Any]]]:
    """Generic series from each step's packed values; buckets of `width` steps aggregated here
    (the whole-history chart of a long run reads rollups instead)."""
    layout_names = store.series_names(session, run_id=run_id)
    wanted = [(n, layout_names.index(n)) for n in names if n in layout_names]
    if not wanted:
        return {}
    query = select(Step.step, Step.series).where(
        Step.run_id == run_id, *_step_filter(Step.step, since, until)
    )
    points: dict[str, list[tuple[int, float]]] = {}
    for step, data in session.execute(query.order_by(Step.step)):
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

    A live page polls with its cursor and replaces the buckets it gets back by their index.
    """
    width = vocab.WINDOW
    bucket = ((Step.step - 1) // width).label("bucket")
    start = (since // width) * width  # the whole bucket holding step since+1
    query = (
        select(
            bucket,
            func.count(Step.step),
            func.avg(Step.true_accuracy),
            func.avg(Step.reward_mean),
            func.avg(Step.format_valid_rate),
        )
        .where(Step.run_id == run_id, *_step_filter(Step.step, start, until))
        .group_by(bucket)
        .order_by(bucket)
    )
    return charts.bucket_table(session.execute(query).all())


# --- alerts -------------------------------------------------------------------------------------


def alerts(session: Session, *, run_id: int, since: int = 0) -> list[dict[str, Any]]:
    """The run's alerts after `since`: those its recorder wrote with each step (an index seek),
    plus any for steps it did not evaluate (evaluated here from the steps, not stored)."""
    run = store.get_run(session, run_id=run_id)
    found = [
        rules.Alert(kind, step, message, series)
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


def warning_counts(session: Session, *, run_ids: Sequence[int]) -> dict[int, int]:
    """Run id → how many of its stored alerts are warnings (runs without any are left out):
    one grouped query over the alerts table, whatever the number of runs."""
    if not run_ids:
        return {}
    warning_kinds = [k for k, s in rules.SEVERITY.items() if s == "warning"]
    rows = session.execute(
        select(AlertRow.run_id, func.count())
        .where(
            AlertRow.run_id.in_(run_ids),
            or_(AlertRow.kind.in_(warning_kinds), AlertRow.kind.not_in(list(rules.SEVERITY))),
        )
        .group_by(AlertRow.run_id)
    )
    return {run_id: n for run_id, n in rows}


def evaluate_alerts(session: Session, *, run_id: int, after: int = 0) -> list[rules.Alert]:
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
        session.scalar(select(Run.prompts_per_step).where(Run.id == run_id))
    )
    found = rules.evaluate(rules.from_history(history), thresholds)
    return [a for a in found if a.step > after]


def run_versions(session: Session, *, run_ids: Sequence[int]) -> dict[int, str]:
    """run_version of several runs in one query (missing runs are left out)."""
    rows = session.execute(
        select(Run.id, Run.created_at, Run.heartbeat_at, Run.current_step, Run.status).where(
            Run.id.in_(run_ids)
        )
    )
    return {row[0]: _version_token(*row) for row in rows}


# --- step viewer --------------------------------------------------------------------------------


def _neighbours(session: Session, run_id: int, step: int) -> dict[str, int | None]:
    """First, previous, next and last recorded steps around `step`: one statement of index seeks."""
    this_run = Step.run_id == run_id
    first, prev, nxt, last = session.execute(
        select(
            select(func.min(Step.step)).where(this_run).scalar_subquery(),
            select(func.max(Step.step)).where(this_run, Step.step < step).scalar_subquery(),
            select(func.min(Step.step)).where(this_run, Step.step > step).scalar_subquery(),
            select(func.max(Step.step)).where(this_run).scalar_subquery(),
        )
    ).one()
    return {"first": first, "prev": prev, "next": nxt, "last": last}


def nearest_step(session: Session, *, run_id: int, step: int) -> int | None:
    """The recorded step closest to `step`: itself if recorded; ties go to the earlier one."""
    if (
        session.scalar(select(Step.step).where(Step.run_id == run_id, Step.step == step))
        is not None
    ):
        return step
    around = _neighbours(session, run_id, step)
    below, above = around["prev"], around["next"]
    if below is None or above is None:
        return below if above is None else above
    return below if step - below <= above - step else above


def step_detail(
    session: Session, *, run_id: int, step: int, max_tokens: int | None = None
) -> dict[str, Any]:
    """One step of a run as the step viewer shows it: its groups, rollouts and neighbours, and
    where retention did not keep its token-level data, the nearest step that has it (per-token
    arrays cut to `max_tokens` positions: serialize.rollout_dict)."""
    run = store.get_run(session, run_id=run_id)
    row = session.scalar(select(Step).where(Step.run_id == run_id, Step.step == step))
    if row is None:
        raise StepNotFound(
            run_id=run_id, step=step, nearest=nearest_step(session, run_id=run_id, step=step)
        )
    rollouts = session.execute(
        select(Rollout, Prompt.text)
        .join(Prompt, Prompt.id == Rollout.prompt_id)
        .where(Rollout.run_id == run_id, Rollout.step == row.rollout_step)
        .order_by(Rollout.group, Rollout.index)
    ).all()
    tokens = list(run.control_tokens)
    if max_tokens is None:
        ids = {i for r, _ in rollouts for i in unpack_ints(r.completion_ids)}
    else:
        ids = {i for r, _ in rollouts for i in head_ints(r.completion_ids, max_tokens)}
    texts = store.token_texts(session, run_id=run_id, ids=ids)
    dicts = [rollout_dict(r, text, tokens, texts, max_tokens=max_tokens) for r, text in rollouts]
    kept = all(r.tokens_kept for r, _ in rollouts)
    return {
        "run": run_dict(run),
        "step": step_dict(row),
        "metrics": dict(sorted(layout.named(row.series, run.series_names or []).items())),
        "nav": _neighbours(session, run_id, step),
        "tokens_kept": kept,
        "nearest_kept": None if kept else nearest_kept_step(session, run_id=run_id, step=step),
        "keep_tokens_every": run.keep_tokens_every,
        "groups": viewer.group_views(dicts),
    }


def nearest_kept_step(session: Session, *, run_id: int, step: int) -> int | None:
    """The step nearest `step` whose token-level data retention kept (ties: the earlier)."""
    kept = [Step.run_id == run_id, Step.tokens_kept.is_(True)]
    row = session.execute(
        select(
            select(func.max(Step.step)).where(*kept, Step.step < step).scalar_subquery(),
            select(func.min(Step.step)).where(*kept, Step.step > step).scalar_subquery(),
        )
    ).one()
    below: int | None = row[0]
    above: int | None = row[1]
    if below is None or above is None:
        return below if above is None else above
    return below if step - below <= above - step else above


# --- compare ------------------------------------------------------------------------------------


def resolve_step(session: Session, *, run_id: int, step: int | None) -> int:
    """The recorded step nearest `step` (the last one when None), for jump links and sliders."""
    store.get_run(session, run_id=run_id)
    found = (
        _bounds(session, run_id=run_id)[1]
        if step is None
        else nearest_step(session, run_id=run_id, step=step)
    )
    if found is None:
        raise NotFound(f"run {run_id} has no recorded steps yet")
    return found


COMPARE_POINTS = 1200  # points per compare chart, shared among its runs (MAX_POINTS each for two)
MIN_COMPARE_POINTS = 60  # a run's share never drops below this
COMPARE_BANDS = 3  # min–max bands up to this many runs: more overlaid bands hide the lines

# memo(key, compute): compute() or what it returned before for the same key (see compare)
Memo = Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any]]


def _no_memo(_key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return compute()


def compare(
    session: Session,
    *,
    run_ids: Sequence[int],
    step: int | None = None,
    max_points: int | None = None,
    max_tokens: int | None = None,
    memo: Memo = _no_memo,
) -> dict[str, Any]:
    """Two or more runs: chart series, summary, config diff, and one step of the first two side
    by side (the last step both have, unless `step` is given; per-token arrays cut to
    `max_tokens` positions, as step_detail).

    Each run's charts come from series() with its share of COMPARE_POINTS (`max_points` per run
    if given), so a long run reads its rollups; values are rounded to what a chart shows and
    bands are left out past COMPARE_BANDS runs. Its summary comes from series()' 25-step buckets
    (queries.bucket_means) and the run's summary columns, not from every step in Python. A run's
    part is the same until the run changes: `memo` may keep it, keyed by the run's version.
    """
    if len(run_ids) < 2:
        raise InvalidInput("compare needs at least two run ids, e.g. /compare?runs=1,2")
    if len(set(run_ids)) != len(run_ids):
        raise InvalidInput("compare needs distinct run ids")
    points = max_points or max(MIN_COMPARE_POINTS, COMPARE_POINTS // len(run_ids))
    bands = len(run_ids) <= COMPARE_BANDS
    versions = run_versions(session, run_ids=run_ids)
    runs, by_run, summary = [], {}, []
    for run_id in run_ids:
        run = run_dict(store.get_run(session, run_id=run_id))  # NotFound for a missing run
        runs.append(run)
        key = f"compare:{points}:{'bands' if bands else 'lines'}@{versions[run_id]}"
        part = memo(key, partial(_compare_run, session, run, points=points, bands=bands))
        by_run[str(run_id)] = part["charts"]
        summary.append(part["summary"])
    pair = run_ids[:2]
    lasts = [_bounds(session, run_id=r)[1] for r in pair]
    if step is None:
        step = min((s for s in lasts if s is not None), default=0)
    side_by_side = []
    for run_id, last in zip(pair, lasts, strict=True):
        try:
            detail: dict[str, Any] | None = step_detail(
                session, run_id=run_id, step=step, max_tokens=max_tokens
            )
        except StepNotFound:
            detail = None
        side_by_side.append({"run_id": run_id, "last_step": last, "detail": detail})
    return {
        "runs": runs,
        "series": by_run,
        "points": points,
        "bands": bands,
        "method": charts.DOWNSAMPLING,
        "summary": summary,
        "config_diff": charts.config_diff(runs),
        "step": step,
        "max_step": max((s for s in lasts if s is not None), default=0),
        "side_by_side": side_by_side,
    }


def _compare_run(
    session: Session, run: dict[str, Any], *, points: int, bands: bool
) -> dict[str, Any]:
    """One run's part of compare: its charts (rounded, bands or not) and its summary."""
    ctrl = [vocab.ctrl(t, "mean") for t in run["control_tokens"]]
    names = [*vocab.COMPARE_SERIES, *ctrl, *vocab.COMPARE_EXTRA]
    data = series(session, run_id=run["id"], names=names, max_points=points)
    return {
        "charts": {
            "bucket": data["bucket"],
            "series": charts.chart_series(data["series"], bands=bands),
        },
        "summary": _summary(session, run, data["buckets"], evaluated=list(data["series"])),
    }


def _summary(
    session: Session, run: dict[str, Any], buckets: dict[str, list[Any]], *, evaluated: list[str]
) -> dict[str, Any]:
    """Compare's summary of one run from its 25-step buckets (what series() returns beside its
    charts), its summary columns, and its last evaluations (read only for the evaluation series
    its charts found)."""
    names = [n for n in vocab.EVAL_SERIES if n in evaluated]
    found = last_values(session, run_id=run["id"], names=names) if names else {}
    return charts.run_summary(run, buckets) | {
        "final_eval": {n: found.get(n) for n in vocab.EVAL_SERIES}
    }


def last_values(session: Session, *, run_id: int, names: Sequence[str]) -> dict[str, Any]:
    """The latest recorded value of each named series: {step, value} or None (a few rows each,
    through the rollups, however long the run)."""
    return store.last_values(session, run_id=run_id, names=names)
