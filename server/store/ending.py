"""How a recorded run ends, and what its recorder may still do once it has (runs.ended_by).

A run that a recorder records (a user's script with RolloutLensCallback, locally or over HTTP)
has no worker of ours to honour a cancel request: the dashboard's cancel ends it at once, and
the recorder learns it on its next write (RunEnded: over HTTP, a 409 with the status). Who ended
a run decides whether its recorder may take it up again:

- the sweeper (`lost`: no heartbeat for a while) — a network cut is not an end: the recorder's
  next heartbeat or steps make it `running` again;
- anyone else (the dashboard's cancel, the recorder's own finish, whatever its status, `lost`
  included) — the run records nothing more; a finish repeating its status is answered as done.
"""

from __future__ import annotations

from typing import Any, cast

from rollout_lens.server.core.errors import NotFound, RunEnded
from rollout_lens.server.store.models import EndedBy, RunRow, RunSource, RunStatus, utcnow
from sqlalchemy import Connection, CursorResult, and_, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

# A run its recorder may write to: running, or lost by the sweeper (or before migration 0017,
# when only the sweeper and the recorder's `finish lost` set `lost`, and no one said which).
REVIVABLE: ColumnElement[bool] = and_(
    RunRow.status == RunStatus.lost,
    or_(RunRow.ended_by.is_(None), RunRow.ended_by == EndedBy.sweeper.value),
)
RECORDING: ColumnElement[bool] = or_(RunRow.status == RunStatus.running, REVIVABLE)


def _alive_sql(mark: str) -> str:
    """recorder_alive's UPDATE as driver SQL (RECORDING written out; SQLite's times are naive
    UTC text, as SQLAlchemy keeps them)."""
    return (
        f"UPDATE runs SET status = {mark}, heartbeat_at = {mark}, finished_at = NULL, "
        f"ended_by = NULL, error = NULL WHERE id = {mark} AND (status = {mark} OR "
        f"(status = {mark} AND (ended_by IS NULL OR ended_by = {mark})))"
    )


_ALIVE_SQLITE, _ALIVE_POSTGRES = _alive_sql("?"), _alive_sql("%s")


def recorded_elsewhere(run: RunRow) -> bool:
    """Whether a recorder of the user's own trains the run (no worker here to ask to stop)."""
    return run.source == RunSource.callback


def may_record(run: RunRow) -> bool:
    """Whether the run's recorder may still write to it (RECORDING, for a row in hand)."""
    if run.status == RunStatus.running:
        return True
    return run.status == RunStatus.lost and run.ended_by in (None, EndedBy.sweeper)


def ended(run: RunRow) -> RunEnded:
    """The error a recorder gets for a run it may no longer write to."""
    return run_ended(run.id, run.status, run.ended_by)


def run_ended(run_id: int, status: str, ended_by: str | None) -> RunEnded:
    """The error a recorder gets for run `run_id`, which ended as `status` (by `ended_by`)."""
    by = f" by {ended_by}" if ended_by else ""
    return RunEnded(
        f"run {run_id} was {status}{by}: it records nothing more",
        run_id=run_id,
        status=status,
        ended_by=ended_by,
    )


def recorder_alive(db: Session | Connection, *, run_id: int) -> None:
    """A recorder's heartbeat, and the first statement of its every write (the run's row is
    held until it commits, so a cancel falls before or after the steps, never amid them): a run
    the sweeper marked lost is running again; RunEnded for a run that someone else ended (it
    is never reopened), NotFound for one deleted.

    On a Connection (a writer's every step) the UPDATE is driver SQL made once: building and
    caching the ORM statement cost the writer's thread 0.45 ms of CPU a step, which at a toy
    step of 25 ms the training thread waits for the GIL."""
    if isinstance(db, Connection):
        postgres = db.dialect.name == "postgresql"
        now = utcnow()
        result: Any = db.exec_driver_sql(
            _ALIVE_POSTGRES if postgres else _ALIVE_SQLITE,
            (
                RunStatus.running.value,
                now if postgres else now.strftime("%Y-%m-%d %H:%M:%S.%f"),
                run_id,
                RunStatus.running.value,
                RunStatus.lost.value,
                EndedBy.sweeper.value,
            ),
        )
    else:
        result = db.execute(
            update(RunRow)
            .where(RunRow.id == run_id, RECORDING)
            .values(
                status=RunStatus.running,
                heartbeat_at=utcnow(),
                finished_at=None,
                ended_by=None,
                # the sweeper's reason goes with its `lost`; a running run has no error to keep
                error=None,
            )
        )
    if _rowcount(result) == 1:
        return
    row = db.execute(select(RunRow.status, RunRow.ended_by).where(RunRow.id == run_id)).first()
    if row is None:
        raise NotFound(f"run {run_id} does not exist")
    raise run_ended(run_id, row.status, row.ended_by)


def finish_recorded(session: Session, *, run_id: int, status: RunStatus, error: str | None) -> None:
    """The recorder ends its run as `status`. A finish repeating the run's status (a retry, or a
    callback finishing `cancelled` after the dashboard cancelled it) changes nothing; any other
    finish of a run that has ended is RunEnded."""
    result = session.execute(
        update(RunRow)
        .where(RunRow.id == run_id, RECORDING)
        .values(
            status=status,
            finished_at=utcnow(),
            heartbeat_at=utcnow(),
            error=error,
            phase=None,
            ended_by=EndedBy.recorder.value,
        )
        .execution_options(synchronize_session=False)
    )
    if _rowcount(result) == 1:
        return
    run = session.get(RunRow, run_id, populate_existing=True)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    if run.status != status:
        raise ended(run)


def cancel_recorded(session: Session, *, run_id: int, ended_by: str) -> bool:
    """End a running recorded run as `cancelled` now (its recorder is told on its next write);
    False if it was no longer running."""
    result = session.execute(
        update(RunRow)
        .where(RunRow.id == run_id, RunRow.status == RunStatus.running)
        .values(
            status=RunStatus.cancelled,
            finished_at=utcnow(),
            phase=None,
            cancel_requested=True,
            ended_by=ended_by,
        )
        .execution_options(synchronize_session=False)
    )
    return _rowcount(result) == 1


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount
