"""Reading what a run recorded, for export, the client and the pages' query modules: steps with
their series, rollouts with their prompt, facts and token texts."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime

from rollout_lens.server.store import layout, prompt_texts
from rollout_lens.server.store.models import RolloutRow, RunRow, RunTokenRow, StepRow
from rollout_lens.server.store.rollups import latest_value
from rollout_lens.server.store.search import IdsText
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session


def last_step(session: Session, *, run_id: int) -> int:
    """The highest recorded step of a run (0 when none)."""
    value = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == run_id))
    return int(value or 0)


def last_recorded_step(session: Session, *, run_id: int) -> int | None:
    """The highest recorded step of a run, or None when it has none (a run may hold step 0)."""
    value = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == run_id))
    return None if value is None else int(value)


def first_recorded(session: Session, *, run_id: int) -> tuple[int, datetime] | None:
    """A run's first recorded step and when it was recorded, or None when it has none."""
    row = session.execute(
        select(StepRow.step, StepRow.recorded_at)
        .where(StepRow.run_id == run_id)
        .order_by(StepRow.step)
        .limit(1)
    ).first()
    return None if row is None else (int(row[0]), row[1])


def steps(session: Session, *, run_id: int, since: int = 0) -> list[StepRow]:
    """Steps of a run after `since`, in order."""
    query = (
        select(StepRow).where(StepRow.run_id == run_id, StepRow.step > since).order_by(StepRow.step)
    )
    return list(session.scalars(query))


def series_names(session: Session, *, run_id: int) -> list[str]:
    """The run's generic series (not the step columns), in layout order."""
    return list(session.scalar(select(RunRow.series_names).where(RunRow.id == run_id)) or [])


def metric_names(session: Session, *, run_id: int) -> list[str]:
    """Every generic series name a run recorded, sorted."""
    return sorted(series_names(session, run_id=run_id))


def step_rollouts(session: Session, *, run_id: int, step: int) -> list[tuple[RolloutRow, str]]:
    """The rollouts the update at `step` trained on, with their prompt text, in group order."""
    query = (
        select(RolloutRow)
        .where(RolloutRow.run_id == run_id, RolloutRow.step == trained_on(session, run_id, step))
        .order_by(RolloutRow.group, RolloutRow.index)
    )
    return prompt_texts.with_prompts(session, session.scalars(query).all())


def trained_on(session: Session, run_id: int, step: int) -> int:
    """The step whose rollouts the update at `step` trained on (its own, unless it reused an
    earlier generation: num_iterations > 1)."""
    rollout_step = session.scalar(
        select(StepRow.rollout_step).where(StepRow.run_id == run_id, StepRow.step == step)
    )
    return rollout_step or step


def iter_rollouts(
    session: Session, *, run_id: int, batch: int = 500, step: int | None = None
) -> Iterator[tuple[RolloutRow, str]]:
    """Every rollout of a run with its prompt text, by step, group and index (streamed); with
    `step`, the rollouts the update at `step` trained on."""
    query = select(RolloutRow).where(RolloutRow.run_id == run_id)
    if step is not None:
        query = query.where(RolloutRow.step == trained_on(session, run_id, step))
    query = query.order_by(RolloutRow.step, RolloutRow.group, RolloutRow.index).execution_options(
        yield_per=batch
    )
    for part in session.scalars(query).partitions():
        yield from prompt_texts.with_prompts(session, part)


def token_texts(
    session: Session, *, run_id: int, ids: Iterable[int] | None = None
) -> dict[int, str]:
    """token id → text, for the ids given (all the run's when None) that the run's recorder
    knew the text of."""
    if ids is None:
        rows = session.execute(
            select(RunTokenRow.token_id, RunTokenRow.text).where(RunTokenRow.run_id == run_id)
        )
        return {token_id: text for token_id, text in rows}
    wanted = sorted(set(ids))
    if session.get_bind().dialect.name == "postgresql":
        # One array parameter: an IN list of a page's ~2,000 ids, one bound parameter each,
        # cost PostgreSQL more to parse and plan than to answer (a third of the group page); and
        # sent as its text (IdsText), not as a Python list that psycopg turns into one: 4,000 ids
        # of a full-shape run were looked up in 25 ms as a list, 15 as text. Hidden from the
        # planner (a sub-select's value), the ids are probes of the primary key: seen, the
        # planner read all 150,000 of the run's tokens against them instead (1,700 ids at 100
        # full steps: 29 ms planned and run, 7 as probes; 4,000: 30 and 22; 8,000: 35 and 32).
        rows = session.execute(
            text(
                "SELECT token_id, text FROM run_tokens WHERE run_id = :run "
                "AND token_id = ANY(CAST((SELECT :ids) AS integer[]))"
            ),
            {"run": run_id, "ids": IdsText("{" + ",".join(map(str, wanted)) + "}")},
        )
        return {token_id: token_text for token_id, token_text in rows}
    # SQLite: the ids as one JSON array, read by json_each (the same reason: a bound parameter
    # an id, in IN lists of 500, was a third of the group page's time to compile)
    rows = session.execute(
        text(
            "SELECT token_id, text FROM run_tokens WHERE run_id = :run "
            "AND token_id IN (SELECT value FROM json_each(:ids))"
        ),
        {"ids": json.dumps(wanted), "run": run_id},
    )
    return {token_id: token_text for token_id, token_text in rows}


class TokenTextCache:
    """Token texts of runs kept across requests (the web app keeps one): a page of a group reads
    the texts of some 3,000 ids, 10-14 ms on either database, the same ones each time.

    A run's texts never change: the recorder only adds run_tokens rows (an id's first text
    stays) and they are deleted with their run. So a text once read is kept under its run's id,
    creation time and source: a new run given a deleted run's id (SQLite reuses the highest id)
    is another key. Ids the run has no text for are asked again each time (a later step may
    record them). At most `limit` texts in all (about 120 bytes each: a 150,000-token
    vocabulary is 18 MB); past it the runs read least recently are dropped, and a run with more
    than `limit` texts is read as before."""

    def __init__(self, limit: int = 500_000) -> None:
        self._limit = limit
        self._runs: OrderedDict[tuple[int, datetime, str], dict[int, str]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._size

    def texts(self, session: Session, run: RunRow, ids: Iterable[int]) -> dict[int, str]:
        """token_texts of these ids of `run`, reading only those not kept."""
        key = (run.id, run.created_at, run.source)
        wanted = set(ids)
        with self._lock:
            kept = self._runs.get(key, {})
            if kept:
                self._runs.move_to_end(key)
            found = {i: kept[i] for i in wanted if i in kept}
        missing = wanted.difference(found)
        if missing:
            read = token_texts(session, run_id=run.id, ids=missing)
            found.update(read)
            self._keep(key, read)
        return found

    def _keep(self, key: tuple[int, datetime, str], read: dict[int, str]) -> None:
        with self._lock:
            kept = self._runs.get(key, {})
            if len(kept) + len(read) > self._limit:
                return
            self._runs[key] = kept
            self._runs.move_to_end(key)
            before = len(kept)
            kept.update(read)
            self._size += len(kept) - before
            while self._size > self._limit:
                _, dropped = self._runs.popitem(last=False)
                self._size -= len(dropped)


def metric_series(
    session: Session, *, run_id: int, names: Sequence[str] | None = None, since: int = 0
) -> dict[str, list[tuple[int, float | None]]]:
    """Generic series of a run after `since`: name → [(step, value)] ordered by step (None
    where the step logged the name without a finite value)."""
    all_series = series_names(session, run_id=run_id)
    wanted = set(all_series if names is None else names)
    out: dict[str, list[tuple[int, float | None]]] = {}
    rows = session.execute(
        select(StepRow.step, StepRow.series)
        .where(StepRow.run_id == run_id, StepRow.step > since)
        .order_by(StepRow.step)
    )
    for step, data in rows:
        for name, value in layout.named(data, all_series).items():
            if name in wanted:
                out.setdefault(name, []).append((step, value))
    return dict(sorted(out.items()))


def iter_steps(
    session: Session, *, run_id: int, page: int = 500
) -> Iterator[tuple[StepRow, dict[str, float | None]]]:
    """Every step of a run with its generic series (name → value), in order, read a page of
    steps at a time (keyset paging: memory stays flat however long the run)."""
    names = series_names(session, run_id=run_id)
    after = 0
    while True:
        rows = list(
            session.scalars(
                select(StepRow)
                .where(StepRow.run_id == run_id, StepRow.step > after)
                .order_by(StepRow.step)
                .limit(page)
            )
        )
        if not rows:
            return
        after = rows[-1].step
        for row in rows:
            yield row, dict(sorted(layout.named(row.series, names).items()))


def last_values(session: Session, *, run_id: int, names: Sequence[str]) -> dict[str, object]:
    """The latest recorded value of each named series: {step, value} or None."""
    out: dict[str, object] = {}
    for name in names:
        found = latest_value(session, run_id=run_id, name=name)
        out[name] = None if found is None else {"step": found[0], "value": found[1]}
    return out
