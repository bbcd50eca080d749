"""The compare page's reads: bounded charts of each run, their summaries, config diff and one
step of the first two side by side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core import vocab
from rollout_lens.server.core.errors import InvalidInput, StepNotFound
from rollout_lens.server.core.read_models import RunData, RunSummary
from rollout_lens.server.core.step_views import CompareData, CompareSide, StepCard
from rollout_lens.server.store.serialize import run_dict
from rollout_lens.server.webapp.queries import chart_data
from rollout_lens.server.webapp.queries.run_page import series
from rollout_lens.server.webapp.queries.runs import run_versions, step_bounds
from rollout_lens.server.webapp.queries.step_page import step_card
from sqlalchemy.orm import Session

# --- compare ------------------------------------------------------------------------------------


COMPARE_POINTS = 1200  # points per compare chart, shared among its runs (MAX_POINTS each for two)
MIN_COMPARE_POINTS = 60  # a run's share never drops below this
COMPARE_BANDS = 3  # min–max bands up to this many runs: more overlaid bands hide the lines

# memo(key, compute): compute() or what it returned before for the same key (see compare)
Memo = Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any]]


def _no_memo(_key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return compute()


def _check_ids(run_ids: Sequence[int]) -> None:
    if len(run_ids) < 2:
        raise InvalidInput("compare needs at least two run ids, e.g. /compare?runs=1,2")
    if len(set(run_ids)) != len(run_ids):
        raise InvalidInput("compare needs distinct run ids")


def compare(
    session: Session,
    *,
    run_ids: Sequence[int],
    step: int | None = None,
    max_points: int | None = None,
    group: int = 0,
    max_tokens: int | None = 0,
    memo: Memo = _no_memo,
    texts_kept: store.TokenTextCache | None = None,
) -> CompareData:
    """Two or more runs: chart series, summary, config diff, and one step of the first two side
    by side (the last step both have, unless `step` is given): one group of it (the first, or
    `group`; step_card: a step of 64 groups is not 512 rollouts here), per-token arrays cut to
    `max_tokens` positions (none by default).

    Each run's charts come from series() with its share of COMPARE_POINTS (`max_points` per run
    if given), so a long run reads its rollups; values are rounded to what a chart shows and
    bands are left out past COMPARE_BANDS runs. Its summary comes from series()' 25-step buckets
    (queries.bucket_means) and the run's summary columns, not from every step in Python. A run's
    part is the same until the run changes: `memo` may keep it, keyed by the run's version. The
    side-by-side groups' token texts are read through `texts_kept` when given.
    """
    _check_ids(run_ids)
    points = max_points or max(MIN_COMPARE_POINTS, COMPARE_POINTS // len(run_ids))
    bands = len(run_ids) <= COMPARE_BANDS
    runs = [run_dict(store.get_run(session, run_id=r)) for r in run_ids]  # NotFound: missing
    versions = run_versions(session, run_ids=run_ids)
    parts = [
        memo(
            f"compare:{points}:{'bands' if bands else 'lines'}@{versions[run['id']]}",
            partial(_compare_run, session, run, points=points, bands=bands),
        )
        for run in runs
    ]
    pair = run_ids[:2]
    lasts = [step_bounds(session, run_id=r)[1] for r in pair]
    if step is None:
        step = min((s for s in lasts if s is not None), default=0)
    side_by_side = [
        _side(
            session, run_id, last, step=step, group=group, max_tokens=max_tokens, texts=texts_kept
        )
        for run_id, last in zip(pair, lasts, strict=True)
    ]
    return {
        "runs": runs,
        "series": {str(run["id"]): part["charts"] for run, part in zip(runs, parts, strict=True)},
        "points": points,
        "bands": bands,
        "method": chart_data.DOWNSAMPLING,
        "summary": [part["summary"] for part in parts],
        "config_diff": chart_data.config_diff(runs),
        "step": step,
        "group": group,
        "max_step": max((s for s in lasts if s is not None), default=0),
        "side_by_side": side_by_side,
    }


def _side(
    session: Session,
    run_id: int,
    last: int | None,
    *,
    step: int,
    group: int,
    max_tokens: int | None,
    texts: store.TokenTextCache | None,
) -> CompareSide:
    """One run's side of the side-by-side step: its step card, None where it has no such step."""
    try:
        detail: StepCard | None = step_card(
            session, run_id=run_id, step=step, group=group, max_tokens=max_tokens, texts_kept=texts
        )
    except StepNotFound:
        detail = None
    return {"run_id": run_id, "last_step": last, "detail": detail}


def _compare_run(session: Session, run: RunData, *, points: int, bands: bool) -> dict[str, Any]:
    """One run's part of compare: its charts (rounded, bands or not) and its summary."""
    ctrl = [vocab.ctrl(t, "mean") for t in run["control_tokens"]]
    names = [*vocab.COMPARE_SERIES, *ctrl, *vocab.COMPARE_EXTRA]
    data = series(session, run_id=run["id"], names=names, max_points=points)
    return {
        "charts": {
            "bucket": data["bucket"],
            "series": chart_data.chart_series(data["series"], bands=bands),
        },
        "summary": _summary(
            session,
            run,
            data["buckets"],
            evaluated=list(data["series"]),
            format_free=chart_data.last_window_mean(data["series"].get(FREE)),
        ),
    }


FREE = vocab.FORMAT_FREE_ACCURACY


def _summary(
    session: Session,
    run: RunData,
    buckets: dict[str, list[Any]],
    *,
    evaluated: list[str],
    format_free: float | None,
) -> RunSummary:
    """Compare's summary of one run from its 25-step buckets (what series() returns beside its
    charts), its summary columns, and its last evaluations (read only for the evaluation series
    its charts found)."""
    names = [n for n in vocab.EVAL_SERIES if n in evaluated]
    found = last_values(session, run_id=run["id"], names=names) if names else {}
    return {
        **chart_data.run_summary(run, buckets),
        "final_eval": {n: found.get(n) for n in vocab.EVAL_SERIES},
        "final_format_free": format_free,
    }


def last_values(session: Session, *, run_id: int, names: Sequence[str]) -> dict[str, Any]:
    """The latest recorded value of each named series: {step, value} or None (a few rows each,
    through the rollups, however long the run)."""
    return store.last_values(session, run_id=run_id, names=names)
