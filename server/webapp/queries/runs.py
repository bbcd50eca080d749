"""The runs page and what every run page shares: the list (paged, sorted, searched), a run's
card, version token, bounds and live state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core import alerts as rules
from rollout_lens.server.core.display import live_text
from rollout_lens.server.core.errors import InvalidInput, NotFound
from rollout_lens.server.core.read_models import ListedRun, LiveState, RunData, RunOverviewData
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store import search
from rollout_lens.server.store.models import (
    ACTIVE_STATUSES,
    AlertRow,
    RunRow,
    RunSource,
    RunStatus,
    StepRow,
)
from rollout_lens.server.store.serialize import run_dict
from rollout_lens.server.webapp.queries import chart_data
from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

# --- runs ---------------------------------------------------------------------------------------

RUN_SORTS: dict[str, Any] = {
    "created": RunRow.id,
    "name": func.lower(RunRow.name),
    "status": RunRow.status,
    "progress": RunRow.current_step * 1.0 / func.nullif(RunRow.total_steps, 0),
    "variant": RunRow.variant,
    "model": func.lower(RunRow.model),
    "k": RunRow.k,
    "group_size": RunRow.group_size,
    "seed": RunRow.seed,
    "accuracy": RunRow.recent_true_accuracy,
    "reward": RunRow.recent_reward,
    "device_minutes": RunRow.device_seconds,
    "cost": RunRow.cost,
}


MAX_SEARCH_WORDS = search.MAX_WORDS  # the explorer's search takes the same
MAX_SEARCH_WORD = search.MAX_WORD_CHARS  # a run name's length


def _like(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def search_words(q: str) -> list[str]:
    """The words of a search (repeats dropped); InvalidInput past MAX_SEARCH_WORDS words or a word
    longer than MAX_SEARCH_WORD (each word is four LIKEs of one statement)."""
    words = list(dict.fromkeys(q.split()))
    if len(words) > MAX_SEARCH_WORDS:
        raise InvalidInput(f"a search takes at most {MAX_SEARCH_WORDS} words, got {len(words)}")
    long = max((len(w) for w in words), default=0)
    if long > MAX_SEARCH_WORD:
        raise InvalidInput(
            f"a search word has at most {MAX_SEARCH_WORD} characters, got one of {long}"
        )
    return words


def _run_filters(q: str, ids: Sequence[int] | None, after: int | None) -> list[ColumnElement[bool]]:
    """Every word of `q` in name, model, variant or status; `ids` or (with both) newer than `after`."""
    where: list[ColumnElement[bool]] = []
    for word in search_words(q):
        pattern = _like(word)
        columns = (RunRow.name, RunRow.model, RunRow.variant, RunRow.status)
        where.append(or_(*(col.ilike(pattern, escape="\\") for col in columns)))
    narrow: list[ColumnElement[bool]] = []
    if ids is not None:
        narrow.append(RunRow.id.in_(ids))
    if after is not None:
        narrow.append(RunRow.id > after)
    if narrow:
        where.append(or_(*narrow))
    return where


def _run_order(sort: str, descending: bool) -> list[Any]:
    """The sort key, missing values last, then newest first."""
    if sort not in RUN_SORTS:
        raise InvalidInput(f"cannot sort runs by {sort!r}; choose one of {', '.join(RUN_SORTS)}")
    key = RUN_SORTS[sort]
    return [key.is_(None), key.desc() if descending else key.asc(), RunRow.id.desc()]


def _listed(session: Session, runs: Sequence[RunRow]) -> list[ListedRun]:
    """Run rows as the runs list shows them: columns, place in the queue, warnings (one grouped
    query over the page's runs), live text."""
    columns = [run_dict(run) for run in runs]
    queued = any(r["status"] == "queued" for r in columns)
    places = store.queue_positions(session) if queued else {}
    warnings = warning_counts(session, run_ids=[r["id"] for r in columns])
    out: list[ListedRun] = []
    for run in columns:
        listed: ListedRun = {
            **run,
            "queue_position": places.get(run["id"]),
            "warnings": warnings.get(run["id"], 0),
            "text": {},
        }
        listed["text"] = live_text(listed)
        out.append(listed)
    return out


def matching_runs(
    session: Session,
    *,
    q: str = "",
    sort: str = "created",
    descending: bool = True,
    ids: Sequence[int] | None = None,
    after: int | None = None,
) -> list[ListedRun]:
    """Every run matching every word of `q` (name, model, variant, status), sorted, missing
    values last; `ids` and `after` narrow as in runs_page. The runs page reads runs_page."""
    query = (
        select(RunRow).where(*_run_filters(q, ids, after)).order_by(*_run_order(sort, descending))
    )
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
    """One page of matching_runs' runs, with how many match and the newest matching id.

    Two statements whatever the number of runs (a count with the newest id, then the page's
    rows), plus one for queue places when the page holds a queued run: the rows are the runs'
    own columns (summary columns the writer keeps current), never a per-run read. Pages are
    offsets into the sorted list; a page past the end is empty (with `pages` saying how many).
    `ids` and `after` narrow the list to those runs or (with both) to those runs plus any run
    newer than `after`: what a live runs page polls for.
    """
    if not 1 <= per_page <= MAX_RUNS_PER_PAGE:
        raise InvalidInput(f"per_page goes from 1 to {MAX_RUNS_PER_PAGE}, got {per_page}")
    if page < 1:
        raise InvalidInput(f"pages are numbered from 1, got {page}")
    where, order = _run_filters(q, ids, after), _run_order(sort, descending)
    total, newest = session.execute(select(func.count(), func.max(RunRow.id)).where(*where)).one()
    offset = (page - 1) * per_page
    rows = session.scalars(
        select(RunRow).where(*where).order_by(*order).offset(offset).limit(per_page)
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


def run_card(session: Session, *, run_id: int) -> RunData:
    """One run's columns (NotFound if there is none)."""
    return run_dict(store.get_run(session, run_id=run_id))


def step_bounds(session: Session, *, run_id: int) -> tuple[int | None, int | None]:
    """First and last recorded step: one statement, two index seeks."""
    first, last = session.execute(
        select(
            select(func.min(StepRow.step)).where(StepRow.run_id == run_id).scalar_subquery(),
            select(func.max(StepRow.step)).where(StepRow.run_id == run_id).scalar_subquery(),
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
        select(RunRow.created_at, RunRow.heartbeat_at, RunRow.current_step, RunRow.status).where(
            RunRow.id == run_id
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"run {run_id} does not exist")
    return _version_token(run_id, *row)


def _version_token(run_id: int, created: Any, beat: Any, step: int, status: str) -> str:
    return f"{run_id}:{created.isoformat() if created else ''}:{beat.isoformat() if beat else ''}:{step}:{status}"


def run_overview(session: Session, *, run_id: int) -> RunOverviewData:
    """A run, its step bounds, the names of its recorded series and its live state (its alerts
    read every step: the routes add them from their cache, see routes.api.run_alerts)."""
    run = store.get_run(session, run_id=run_id)
    first, last = step_bounds(session, run_id=run_id)
    return {
        "run": run_dict(run),
        "first_step": first,
        "last_step": last,
        "series_names": series_names(session, run_id=run_id),
        "live": run_live(session, run_id=run_id),
    }


RATE_WINDOW = 10  # recent steps that the steps-per-second figure averages over


def run_live(session: Session, *, run_id: int) -> LiveState:
    """What a live page shows besides the charts: progress, place in the queue, steps per second
    and ETA, and which of cancel and resume apply. Reads at most RATE_WINDOW step rows."""
    run = store.get_run(session, run_id=run_id)
    out = chart_data.run_progress(run_dict(run))
    rate = None
    if run.status == RunStatus.running and run.started_at is not None:
        recent = session.execute(
            select(StepRow.step, StepRow.recorded_at)
            .where(StepRow.run_id == run_id, StepRow.recorded_at >= run.started_at)
            .order_by(StepRow.step.desc())
            .limit(RATE_WINDOW)
        ).all()
        rate = chart_data.steps_per_second([(s, t) for s, t in recent])
    remaining = max(run.total_steps - run.current_step, 0)
    live: LiveState = {
        **out,
        "queue_position": store.queue_position(session, run_id=run_id),
        "steps_per_second": rate,
        "eta_seconds": remaining / rate if rate else None,
        "cancel_requested": bool(run.cancel_requested),
        "checkpoint_step": run.checkpoint_step,
        "can_cancel": run.status in ACTIVE_STATUSES and not run.cancel_requested,
        "can_resume": run.status in store.RESUMABLE_STATUSES and run.source == RunSource.launched,
        "summary": "",
    }
    # both read the fields above: the text gains the queue position, `text` keeps its place
    live["summary"] = chart_data.live_summary(live)
    live["text"] = live_text(live)
    return live


def run_versions(session: Session, *, run_ids: Sequence[int]) -> dict[int, str]:
    """run_version of several runs in one query (missing runs are left out)."""
    rows = session.execute(
        select(
            RunRow.id, RunRow.created_at, RunRow.heartbeat_at, RunRow.current_step, RunRow.status
        ).where(RunRow.id.in_(run_ids))
    )
    return {row[0]: _version_token(*row) for row in rows}


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
