"""Deleting a run: its steps, rollouts, metrics, rollups and prompt rollups, and the prompts no other run uses
(prompts are shared by text hash) with the prompt dictionaries no prompt left uses. All SQL of a deletion lives here; server/webapp/control.py adds the
broker message and the files on disk."""

from __future__ import annotations

from typing import Any, cast

from rollout_lens.server.core.errors import InvalidState, NotFound
from rollout_lens.server.store import prompt_rollups, prompt_texts, search
from rollout_lens.server.store.models import (
    AlertRow,
    FactsRow,
    PromptRow,
    RolloutDataRow,
    RolloutRow,
    RollupRow,
    RunRow,
    RunSource,
    RunStatus,
    RunTokenRow,
    StepRow,
)
from sqlalchemy import CursorResult, delete, exists, or_, select, update
from sqlalchemy.orm import Session


def delete_run(session: Session, *, run_id: int) -> str | None:
    """Delete a run that is not training here and everything recorded for it; returns its
    broker task id (a queued run's message may still be waiting). Not committed here.

    A launched running run is refused (InvalidState: cancel it first); a running run a user's
    script records is deleted (its recorder's next request finds no run: it stops recording,
    the script trains on). The first statement locks the run's row while it is deletable, so a
    worker cannot claim it while it is being deleted; a worker that takes its message later
    finds no run and skips it.
    """
    deletable = or_(RunRow.status != RunStatus.running, RunRow.source == RunSource.callback)
    locked = session.execute(
        update(RunRow).where(RunRow.id == run_id, deletable).values(cancel_requested=True)
    )
    if cast(CursorResult[Any], locked).rowcount != 1:
        if session.get(RunRow, run_id) is None:
            raise NotFound(f"run {run_id} does not exist")
        raise InvalidState(
            f"run {run_id} is running: cancel it first, and delete it once it has stopped"
        )
    task_id = session.scalar(select(RunRow.task_id).where(RunRow.id == run_id))
    prompt_ids = set(
        session.scalars(select(RolloutRow.prompt_id).where(RolloutRow.run_id == run_id).distinct())
    )
    facts_ids = set(
        session.scalars(
            select(RolloutRow.facts_id)
            .where(RolloutRow.run_id == run_id, RolloutRow.facts_id.is_not(None))
            .distinct()
        )
    )
    # The arrays first (one statement, not a cascade row by row), then the search index.
    session.execute(
        delete(RolloutDataRow).where(
            RolloutDataRow.rollout_id.in_(select(RolloutRow.id).where(RolloutRow.run_id == run_id))
        )
    )
    search.drop_run(session.connection(), run_id=run_id)
    prompt_rollups.delete_run(session, run_id=run_id)
    for table in (RolloutRow, AlertRow, RollupRow, RunTokenRow, StepRow):
        session.execute(delete(table).where(table.run_id == run_id))
    session.execute(delete(RunRow).where(RunRow.id == run_id))
    # Prompts and facts are shared between runs: only those no other run uses go.
    if prompt_ids:
        still_used = exists().where(RolloutRow.prompt_id == PromptRow.id)
        unused = [PromptRow.id.in_(prompt_ids), ~still_used]
        gone = session.execute(
            select(PromptRow.id, PromptRow.dictionary_id, PromptRow.packed).where(*unused)
        ).all()
        texts = prompt_texts.decode(session, [(i, d, packed) for i, d, packed in gone])
        search.forget_prompts(session.connection(), list(texts.items()))
        session.execute(delete(PromptRow).where(*unused))
        prompt_texts.forget_dictionaries(session, {d for _, d, _ in gone if d is not None})
    if facts_ids:
        facts_used = exists().where(RolloutRow.facts_id == FactsRow.id)
        session.execute(delete(FactsRow).where(FactsRow.id.in_(facts_ids), ~facts_used))
    return task_id
