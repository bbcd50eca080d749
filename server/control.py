"""What the dashboard changes: launch, cancel and resume runs (the store and the queue together).

Each is all or nothing: a launch or resume whose message cannot be queued leaves the runs as
they were. Routes call these; nothing here knows about requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery
from rollout_lens.server import store
from rollout_lens.server.domain.runconfig import RunConfig
from rollout_lens.server.errors import BrokerUnavailable
from rollout_lens.server.queue import check_broker, enqueue_run
from sqlalchemy.orm import Session


def launch_runs(session: Session, celery: Celery, configs: Sequence[RunConfig]) -> list[int]:
    """Create one queued run per config and enqueue each; all or nothing.

    The broker is checked before any row exists; if an enqueue still fails, the runs created
    for this launch are deleted again (the rows are committed first: a worker may pick a
    message up at once and must find its run).
    """
    check_broker(celery)
    ids = [store.create_run(session, **c.run_columns()).id for c in configs]
    session.commit()
    try:
        for run_id in ids:
            enqueue_run(celery, run_id=run_id)
    except BrokerUnavailable:
        store.discard_queued_runs(session, run_ids=ids)
        session.commit()
        raise
    return ids


def cancel(session: Session, run_id: int) -> None:
    """Cancel a queued run now; ask a running one to stop (it does within a step or two)."""
    store.request_cancel(session, run_id=run_id)
    session.commit()


def resume(session: Session, celery: Celery, run_id: int) -> None:
    """Queue a lost, failed or cancelled run again; the worker resumes from its checkpoint."""
    check_broker(celery)
    before = store.get_run(session, run_id=run_id)
    status, error, finished_at = before.status, before.error, before.finished_at
    store.requeue_for_resume(session, run_id=run_id)
    session.commit()
    try:
        enqueue_run(celery, run_id=run_id)
    except BrokerUnavailable:
        store.restore_status(
            session, run_id=run_id, status=status, error=error, finished_at=finished_at
        )
        session.commit()
        raise
