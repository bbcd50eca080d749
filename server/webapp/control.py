"""What the dashboard changes: launch, cancel and resume runs (the store and the queue together).

Each is all or nothing: a launch or resume whose message cannot be queued leaves the runs as
they were. Routes call these; nothing here knows about requests.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence

from celery import Celery
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import BrokerUnavailable, QueueFull
from rollout_lens.server.core.queue import check_broker, enqueue_run, revoke_task
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store import deletion
from rollout_lens.server.store.models import by_dashboard
from sqlalchemy.orm import Session


def _check_room(session: Session, *, adding: int, max_queued: int) -> None:
    """QueueFull unless `adding` more runs keep the queue within `max_queued` (checked before
    anything is queued: a script cannot fill the workers' queue for days)."""
    waiting = store.queued_count(session)
    if waiting + adding > max_queued:
        runs = "a run" if adding == 1 else f"{adding} runs"
        raise QueueFull(
            f"the queue is full: {waiting} runs wait and at most {max_queued} may "
            f"(ROLLOUT_LENS_MAX_QUEUED_RUNS), so {runs} cannot be queued now; let some start "
            "or cancel some"
        )


def launch_runs(
    session: Session, celery: Celery, configs: Sequence[RunConfig], *, max_queued: int
) -> list[int]:
    """Create one queued run per config and enqueue each; all or nothing (QueueFull past
    `max_queued` waiting runs).

    The broker is checked before any row exists; if an enqueue still fails, the runs created
    for this launch are deleted again (the rows are committed first: a worker may pick a
    message up at once and must find its run).
    """
    _check_room(session, adding=len(configs), max_queued=max_queued)
    check_broker(celery)
    ids = [store.create_launched_run(session, c.run_columns()).id for c in configs]
    session.commit()
    try:
        for run_id in ids:
            store.set_task_id(session, run_id=run_id, task_id=enqueue_run(celery, run_id=run_id))
            session.commit()  # remembered so that deleting the queued run can revoke it
    except BrokerUnavailable:
        store.discard_queued_runs(session, run_ids=ids)
        session.commit()
        raise
    return ids


def cancel(session: Session, run_id: int, *, who: str | None = None) -> None:
    """Cancel a queued run now, and a running run a user's recorder trains (it is told on its
    next request); ask a launched running one to stop (it does within a step or two). `who`:
    the Guard's name of the caller (security.caller_name), kept as runs.ended_by."""
    store.request_cancel(session, run_id=run_id, ended_by=by_dashboard(who))
    session.commit()


def resume(session: Session, celery: Celery, run_id: int, *, max_queued: int) -> None:
    """Queue a lost, failed or cancelled run again; the worker resumes from its checkpoint
    (QueueFull past `max_queued` waiting runs)."""
    _check_room(session, adding=1, max_queued=max_queued)
    check_broker(celery)
    before = store.get_run(session, run_id=run_id)
    status, error, finished_at = before.status, before.error, before.finished_at
    ended_by = before.ended_by
    store.requeue_for_resume(session, run_id=run_id)
    session.commit()
    try:
        store.set_task_id(session, run_id=run_id, task_id=enqueue_run(celery, run_id=run_id))
        session.commit()
    except BrokerUnavailable:
        store.restore_status(
            session,
            run_id=run_id,
            status=status,
            error=error,
            finished_at=finished_at,
            ended_by=ended_by,
        )
        session.commit()
        raise


log = logging.getLogger(__name__)


def delete(session: Session, celery: Celery, settings: Settings, run_id: int) -> None:
    """Delete a run that is not training here (InvalidState for a launched running one: cancel
    it first; a user's script recording a running one stops recording) with everything recorded
    for it and its files under the data dir; a queued run's broker message
    is revoked (best effort: a worker that gets it anyway finds no run and skips it)."""
    task_id = deletion.delete_run(session, run_id=run_id)
    session.commit()
    if task_id:
        try:
            revoke_task(celery, task_id)
        except (BrokerUnavailable, NotImplementedError) as exc:  # the run is gone either way
            log.info("could not revoke task %s of deleted run %s: %s", task_id, run_id, exc)
    shutil.rmtree(settings.run_dir(run_id), ignore_errors=True)
