"""Deleting a run: its steps, rollouts, metrics and rollups, and the prompts no other run uses
(prompts are shared by text hash). All SQL of a deletion lives here; server/webapp/control.py adds the
broker message and the files on disk."""

from __future__ import annotations

from typing import Any, cast

from rollout_lens.server.core.errors import InvalidState, NotFound
from rollout_lens.server.store import search
from rollout_lens.server.store.models import (
    AlertRow,
    Facts,
    Prompt,
    Rollout,
    RolloutData,
    Rollup,
    Run,
    RunStatus,
    RunToken,
    Step,
)
from sqlalchemy import CursorResult, delete, exists, select, update
from sqlalchemy.orm import Session


def delete_run(session: Session, *, run_id: int) -> str | None:
    """Delete a run that is not training and everything recorded for it; returns its broker
    task id (a queued run's message may still be waiting). Not committed here.

    A running run is refused (InvalidState: cancel it first). The first statement locks the
    run's row while it is not running, so a worker cannot claim it while it is being deleted;
    a worker that takes its message later finds no run and skips it.
    """
    locked = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status != RunStatus.running)
        .values(cancel_requested=True)
    )
    if cast(CursorResult[Any], locked).rowcount != 1:
        if session.get(Run, run_id) is None:
            raise NotFound(f"run {run_id} does not exist")
        raise InvalidState(
            f"run {run_id} is running: cancel it first, and delete it once it has stopped"
        )
    task_id = session.scalar(select(Run.task_id).where(Run.id == run_id))
    prompt_ids = set(
        session.scalars(select(Rollout.prompt_id).where(Rollout.run_id == run_id).distinct())
    )
    facts_ids = set(
        session.scalars(
            select(Rollout.facts_id)
            .where(Rollout.run_id == run_id, Rollout.facts_id.is_not(None))
            .distinct()
        )
    )
    # The arrays first (one statement, not a cascade row by row), then the search index.
    session.execute(
        delete(RolloutData).where(
            RolloutData.rollout_id.in_(select(Rollout.id).where(Rollout.run_id == run_id))
        )
    )
    search.drop_run(session.connection(), run_id=run_id)
    for table in (Rollout, AlertRow, Rollup, RunToken, Step):
        session.execute(delete(table).where(table.run_id == run_id))
    session.execute(delete(Run).where(Run.id == run_id))
    # Prompts and facts are shared between runs: only those no other run uses go.
    if prompt_ids:
        still_used = exists().where(Rollout.prompt_id == Prompt.id)
        unused = [Prompt.id.in_(prompt_ids), ~still_used]
        gone = session.execute(select(Prompt.id, Prompt.text).where(*unused)).all()
        search.forget_prompts(session.connection(), gone)
        session.execute(delete(Prompt).where(*unused))
    if facts_ids:
        facts_used = exists().where(Rollout.facts_id == Facts.id)
        session.execute(delete(Facts).where(Facts.id.in_(facts_ids), ~facts_used))
    return task_id
