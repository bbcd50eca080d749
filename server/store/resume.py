"""A trainer resumed from a checkpoint continues its run, and the writers of one run's steps go
one at a time (a resume, several web processes, the local writer).

The rule: a resumed trainer says the checkpoint's step when it starts (`resume_run`); every step
after it is deleted and the run is running again, under a new record epoch, so the resumed
steps replace the dead process's later ones and the run holds each step once. Steps only ever
rise: a step the run does not have that comes before its last one is refused.
"""

from __future__ import annotations

from rollout_lens.server.core.errors import NotFound
from rollout_lens.server.store import ending
from rollout_lens.server.store.models import RunRow, RunStatus, utcnow
from rollout_lens.server.store.runs import truncate_after
from sqlalchemy import select, update
from sqlalchemy.orm import Session

RESUMES_FROM = (RunStatus.running, RunStatus.lost, RunStatus.failed)
REFUSAL_NOTES = 5  # refusals a run's notes list; later ones are counted in one more note
REFUSED = "the dashboard refused "
MORE_REFUSED = "later refusals, not listed: "
REFUSAL_CHARS = 500


def lock_run(session: Session, *, run_id: int) -> tuple[str, int] | None:
    """Hold the run's row until the transaction ends, so its writers go one at a time: the
    row's lock on PostgreSQL; on SQLite, whose one writer at a time is the whole database, a
    write takes that lock now (a read would not, and two readers would both go on to write).
    (status, record epoch), or None when there is no such run."""
    if session.get_bind().dialect.name == "postgresql":
        query = select(RunRow.status, RunRow.record_epoch).where(RunRow.id == run_id)
        row = session.execute(query.with_for_update()).first()
    else:
        row = session.execute(
            update(RunRow)
            .where(RunRow.id == run_id)
            .values(record_epoch=RunRow.record_epoch)
            .returning(RunRow.status, RunRow.record_epoch)
        ).first()
    return None if row is None else (str(row[0]), int(row[1]))


def resume_run(
    session: Session,
    *,
    run_id: int,
    after_step: int,
    worker_host: str | None = None,
    device: str | None = None,
) -> int:
    """A trainer resumed from its checkpoint at `after_step` continues the run (see the module
    docstring): the steps after it go, the run is running again, its end (finished_at,
    ended_by, error) is cleared and its record epoch goes up by one; returns the new epoch.
    A completed or cancelled run records nothing more (RunEnded, an InvalidState)."""
    found = lock_run(session, run_id=run_id)
    if found is None:
        raise NotFound(f"run {run_id} does not exist")
    status, epoch = found
    if status not in RESUMES_FROM:
        # a 409 with the run's status: a resumed trainer of a run the dashboard cancelled
        # stops training, one of a completed run stops recording
        by = session.scalar(select(RunRow.ended_by).where(RunRow.id == run_id))
        raise ending.run_ended(run_id, status, by)
    truncate_after(session, run_id=run_id, step=after_step)
    where = {"worker_host": worker_host, "device": device}
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id)
        .values(
            status=RunStatus.running,
            finished_at=None,
            ended_by=None,
            error=None,
            phase=None,
            heartbeat_at=utcnow(),
            record_epoch=epoch + 1,
            **{k: v for k, v in where.items() if v is not None},
        )
    )
    for obj in list(session.identity_map.values()):
        if isinstance(obj, RunRow) and obj.id == run_id:
            session.refresh(obj)
    return epoch + 1


def note_refusal(session: Session, *, run_id: int, what: str, why: str) -> None:
    """Say on the run that the dashboard refused steps its recorder sent (the recorder drops
    them and goes on): the first REFUSAL_NOTES refusals each in a note, later ones counted in
    one more, since a sender must not grow a run's notes without bound."""
    if lock_run(session, run_id=run_id) is None:
        return
    notes = list(session.scalar(select(RunRow.notes).where(RunRow.id == run_id)) or [])
    listed = sum(1 for n in notes if n.startswith(REFUSED))
    note = f"{REFUSED}{what}: {why}"[:REFUSAL_CHARS]
    if note in notes:  # said (a body refused, then its step alone as the recorder splits it)
        return
    if listed < REFUSAL_NOTES:
        notes.append(note)
    else:
        counted = [i for i, n in enumerate(notes) if n.startswith(MORE_REFUSED)]
        if counted:
            at = counted[-1]
            said = notes[at][len(MORE_REFUSED) :]
            count = int(said) + 1 if said.isascii() and said.isdecimal() and len(said) < 10 else 1
            notes[at] = f"{MORE_REFUSED}{count}"
        else:
            notes.append(f"{MORE_REFUSED}1")
    session.execute(update(RunRow).where(RunRow.id == run_id).values(notes=notes))
