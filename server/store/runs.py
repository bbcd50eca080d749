"""Run lifecycle and the launch queue: create, claim, cancel, resume, finish, liveness."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from rollout_lens.server.core.errors import InvalidState, NotFound
from rollout_lens.server.core.vocab import WINDOW
from rollout_lens.server.store import ending, layout, prompt_rollups, rollups, search
from rollout_lens.server.store.models import (
    AlertRow,
    EndedBy,
    RolloutDataRow,
    RolloutRow,
    RunRow,
    RunSource,
    RunStatus,
    StepRow,
    utcnow,
)
from sqlalchemy import CursorResult, delete, func, select, true, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

RESUMABLE_STATUSES = (RunStatus.lost, RunStatus.failed, RunStatus.cancelled)


# --- runs ---------------------------------------------------------------------------------------


def create_run(
    session: Session,
    *,
    name: str,
    model: str,
    total_steps: int,
    group_size: int,
    prompts_per_step: int = 1,
    seed: int = 0,
    variant: str | None = None,
    k: int | None = None,
    config: dict[str, Any] | None = None,
    control_tokens: Sequence[str] = (),
    status: RunStatus = RunStatus.queued,
    source: RunSource = RunSource.launched,
    notes: Sequence[str] = (),
    keep_tokens_every: int | None = None,
) -> RunRow:
    """Insert a run and return it with its id."""
    run = RunRow(
        name=name,
        model=model,
        total_steps=total_steps,
        group_size=group_size,
        prompts_per_step=prompts_per_step,
        seed=seed,
        variant=variant,
        k=k,
        config=dict(config or {}),
        control_tokens=list(control_tokens),
        status=status,
        source=source,
        notes=list(notes),
        keep_tokens_every=keep_tokens_every,
    )
    session.add(run)
    session.flush()
    return run


NAME_LENGTH = 200  # the runs.name column


def unique_run_name(session: Session, *, name: str) -> str:
    """`name`, or with the first free ` (2)`, ` (3)`… when a run already has it: two launches of
    one preset must not show as two runs of the same name."""
    taken = set(
        session.scalars(
            select(RunRow.name).where(RunRow.name.startswith(name[:NAME_LENGTH], autoescape=True))
        )
    )
    if name not in taken:
        return name
    n = 2
    while True:
        suffix = f" ({n})"
        candidate = name[: NAME_LENGTH - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
        n += 1


def create_launched_run(session: Session, columns: dict[str, Any]) -> RunRow:
    """A launched run from RunConfig.run_columns(), under a name no other run has (its config
    says the same name)."""
    name = unique_run_name(session, name=columns["name"])
    config = dict(columns.get("config") or {})
    if "name" in config:
        config["name"] = name
    return create_run(session, **(columns | {"name": name, "config": config}))


def get_run(session: Session, *, run_id: int) -> RunRow:
    """The run, or NotFound."""
    run = session.get(RunRow, run_id)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    return run


def list_runs(session: Session, *, limit: int | None = None) -> list[RunRow]:
    """Runs, newest first."""
    query = select(RunRow).order_by(RunRow.id.desc())
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query))


def mark_running(
    session: Session,
    *,
    run_id: int,
    worker_host: str,
    device: str,
    control_tokens: Sequence[str],
    notes: Sequence[str] = (),
) -> None:
    """The run has started training on `device`; `notes` (how it is recorded) join its notes
    once (a resumed run says them again)."""
    now = utcnow()
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id)
        .values(
            status=RunStatus.running,
            worker_host=worker_host,
            device=device,
            control_tokens=list(control_tokens),
            started_at=now,
            heartbeat_at=now,
            error=None,
            phase=None,
        )
    )
    if notes:
        run = get_run(session, run_id=run_id)
        run.notes = [*run.notes, *(n for n in notes if n not in run.notes)]


def mark_finished(
    session: Session,
    *,
    run_id: int,
    status: RunStatus,
    error: str | None = None,
    ended_by: str | None = None,
) -> None:
    """The run has ended as completed, failed, cancelled or lost, by `ended_by` (EndedBy). A run
    ending `cancelled` keeps who asked it to stop (request_cancel), where someone did."""
    by: ColumnElement[str | None] | str | None = ended_by
    if status == RunStatus.cancelled:
        by = func.coalesce(RunRow.ended_by, ended_by)
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id)
        .values(status=status, finished_at=utcnow(), error=error, phase=None, ended_by=by)
    )


PHASE_LENGTH = 200


def set_phase(session: Session, *, run_id: int, phase: str | None) -> None:
    """What the run is doing before its first step (None: nothing to say beyond its status);
    it counts as a heartbeat."""
    text = None if phase is None else phase[:PHASE_LENGTH]
    session.execute(
        update(RunRow).where(RunRow.id == run_id).values(phase=text, heartbeat_at=utcnow())
    )


def add_device_time(
    session: Session, *, run_id: int, seconds: float, price_per_hour: float
) -> None:
    """Account device time and its estimated cost on the run."""
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id)
        .values(
            device_seconds=RunRow.device_seconds + seconds,
            cost=RunRow.cost + seconds / 3600.0 * price_per_hour,
            heartbeat_at=utcnow(),
        )
    )


def set_dropped(session: Session, *, run_id: int, steps: int, rollouts: int) -> None:
    """What a recorder had to drop (the database away longer than its buffer lasted)."""
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id)
        .values(dropped_steps=steps, dropped_rollouts=rollouts)
    )


def heartbeat(session: Session, *, run_id: int, at: datetime | None = None) -> None:
    """The worker training this run is alive."""
    session.execute(update(RunRow).where(RunRow.id == run_id).values(heartbeat_at=at or utcnow()))


# --- launch, cancel, resume, liveness ----------------------------------------------------------


def claim_run(session: Session, *, run_id: int, task_id: str) -> bool:
    """Atomically take a queued run for one task; False if another delivery already has it."""
    result = session.execute(
        update(RunRow)
        .where(RunRow.id == run_id, RunRow.status == RunStatus.queued)
        .values(
            status=RunStatus.running,
            task_id=task_id,
            heartbeat_at=utcnow(),
            phase="starting: the worker is loading torch and TRL",
        )
    )
    return cast(CursorResult[Any], result).rowcount == 1


def set_task_id(session: Session, *, run_id: int, task_id: str) -> None:
    """Remember which broker task will train the run."""
    session.execute(update(RunRow).where(RunRow.id == run_id).values(task_id=task_id))


def request_cancel(session: Session, *, run_id: int, ended_by: str = EndedBy.dashboard) -> str:
    """Cancel a queued run now, or ask a running one to stop; returns the resulting status.

    A run a recorder of the user's own trains is cancelled at once (its recorder is told on its
    next write and stops training: server/store/ending.py); a launched one stops within a step
    or two, its worker ending it. `ended_by` (models.by_dashboard) says who asked."""
    run = get_run(session, run_id=run_id)
    if run.status == RunStatus.queued:
        mark_finished(session, run_id=run_id, status=RunStatus.cancelled, ended_by=ended_by)
        return RunStatus.cancelled
    if run.status == RunStatus.running and ending.recorded_elsewhere(run):
        if ending.cancel_recorded(session, run_id=run_id, ended_by=ended_by):
            return RunStatus.cancelled
        session.refresh(run)  # it ended meanwhile
    elif run.status == RunStatus.running:
        # who asked is kept until the worker ends the run cancelled (mark_finished)
        session.execute(
            update(RunRow)
            .where(RunRow.id == run_id)
            .values(cancel_requested=True, ended_by=ended_by)
        )
        return RunStatus.running
    raise InvalidState(
        f"run {run_id} is {run.status}: only queued or running runs can be cancelled"
    )


def cancel_requested(session: Session, *, run_id: int) -> bool:
    """Whether someone asked the run to stop."""
    return bool(session.scalar(select(RunRow.cancel_requested).where(RunRow.id == run_id)))


def requeue_for_resume(session: Session, *, run_id: int) -> RunRow:
    """Put a lost, failed or cancelled run back in the queue to continue from its checkpoint."""
    run = get_run(session, run_id=run_id)
    if run.status not in RESUMABLE_STATUSES:
        raise InvalidState(
            f"run {run_id} is {run.status}: only lost, failed or cancelled runs can be resumed"
        )
    if run.source != RunSource.launched:
        # Its checkpoints (if any) live where it was trained, not here.
        raise InvalidState(f"run {run_id} was not launched here ({run.source}): it cannot resume")
    run.status = RunStatus.queued
    run.cancel_requested = False
    run.error = None
    run.finished_at = None
    run.ended_by = None
    return run


def set_checkpoint(session: Session, *, run_id: int, step: int) -> None:
    """Every step up to `step` is recorded and a checkpoint of it is on disk."""
    session.execute(update(RunRow).where(RunRow.id == run_id).values(checkpoint_step=step))


def truncate_after(session: Session, *, run_id: int, step: int) -> None:
    """Delete what was recorded after `step` (before resuming from a checkpoint at `step`): the
    run then reads as a run that never had those steps (its rollups, summary columns and series
    names), except for the device time and cost already spent and the token texts it learned."""
    conn = session.connection()
    search.forget_after(conn, run_id=run_id, step=step)
    later = select(RolloutRow.id).where(RolloutRow.run_id == run_id, RolloutRow.step > step)
    # the arrays first (one statement, not a cascade row by row), as a deletion does
    session.execute(delete(RolloutDataRow).where(RolloutDataRow.rollout_id.in_(later)))
    for model in (RolloutRow, StepRow, AlertRow):
        session.execute(delete(model).where(model.run_id == run_id, model.step > step))
    rollups.forget_after(session, run_id=run_id, step=step)
    prompt_rollups.forget_after(session, run_id=run_id, step=step)
    recent = (
        select(StepRow.true_accuracy, StepRow.reward_mean)
        .where(StepRow.run_id == run_id)
        .order_by(StepRow.step.desc())
        .limit(WINDOW)
        .subquery()
    )
    accuracy, reward = session.execute(
        select(func.avg(recent.c.true_accuracy), func.avg(recent.c.reward_mean))
    ).one()
    kept = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == run_id)) or 0
    run = session.execute(
        select(RunRow.series_names, RunRow.checkpoint_step).where(RunRow.id == run_id)
    ).one()
    names = list(run.series_names or [])
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id)
        .values(
            current_step=kept,
            alerts_through=kept,
            recent_true_accuracy=accuracy,
            recent_reward=reward,
            series_names=names[: _names_used(session, run_id=run_id, names=len(names))],
            checkpoint_step=None if run.checkpoint_step is None else min(run.checkpoint_step, step),
        )
    )


def _names_used(session: Session, *, run_id: int, names: int) -> int:
    """How many of a run's series names its steps use: names are appended as steps first log
    them, so those only later steps logged are the list's tail."""
    used = 0
    for (data,) in session.execute(
        select(StepRow.series).where(StepRow.run_id == run_id, StepRow.series.is_not(None))
    ):
        used = max(used, layout.names_logged(data))
        if used >= names:
            break
    return used


def mark_lost_runs(session: Session, *, stale_after: timedelta) -> list[int]:
    """Runs whose process stopped beating: `running` ones, and `queued` ones a process had taken
    (their `phase` says it was starting them: a run waiting in the queue has none). Mark them
    lost with the reason; return their ids."""
    cutoff = utcnow() - stale_after
    seconds = _seconds_text(stale_after.total_seconds())
    reasons = {
        RunStatus.running: f"the worker stopped sending heartbeats for over {seconds} s",
        RunStatus.queued: "its process stopped while starting the run (no heartbeat for over "
        f"{seconds} s)",
    }
    lost: list[int] = []
    for status, reason in reasons.items():
        taken = RunRow.phase.is_not(None) if status == RunStatus.queued else true()
        stale = (RunRow.status == status, RunRow.heartbeat_at < cutoff, taken)
        ids = list(session.scalars(select(RunRow.id).where(*stale)))
        if ids:
            session.execute(
                update(RunRow)
                .where(RunRow.id.in_(ids), *stale)
                .values(
                    status=RunStatus.lost,
                    finished_at=utcnow(),
                    error=reason,
                    phase=None,
                    ended_by=EndedBy.sweeper.value,
                )
            )
        lost += ids
    return sorted(lost)


def _seconds_text(seconds: float) -> str:
    """`86400.0` → `86,400`; `1.5` → `1.5`: the whole threshold (timedelta.seconds drops days)."""
    return f"{seconds:,.3f}".rstrip("0").rstrip(".")


def queue_position(session: Session, *, run_id: int) -> int | None:
    """1 for the next queued run to train, None when the run is not queued."""
    run = get_run(session, run_id=run_id)
    if run.status != RunStatus.queued:
        return None
    ahead = session.scalar(
        select(func.count()).where(RunRow.status == RunStatus.queued, RunRow.id < run_id)
    )
    return int(ahead or 0) + 1


# --- launch from the web app (appended) ---------------------------------------------------------


def discard_queued_runs(session: Session, *, run_ids: Sequence[int]) -> list[int]:
    """Delete runs that are still queued (a launch whose enqueue failed); return their ids.

    A run a worker already claimed is left alone: its broker message got through.
    """
    ids = list(
        session.scalars(
            select(RunRow.id).where(RunRow.id.in_(run_ids), RunRow.status == RunStatus.queued)
        )
    )
    if ids:
        session.execute(delete(RunRow).where(RunRow.id.in_(ids)))
    return ids


def restore_status(
    session: Session,
    *,
    run_id: int,
    status: str,
    error: str | None,
    finished_at: datetime | None,
    ended_by: str | None = None,
) -> None:
    """Undo requeue_for_resume when the resumed run could not be enqueued (still queued only)."""
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id, RunRow.status == RunStatus.queued)
        .values(status=status, error=error, finished_at=finished_at, ended_by=ended_by)
    )


def queued_count(session: Session) -> int:
    """How many runs wait in the queue."""
    count = session.scalar(select(func.count()).where(RunRow.status == RunStatus.queued))
    return int(count or 0)


def queue_positions(session: Session) -> dict[int, int]:
    """Every queued run's place in the queue (1: the next to train), in one query."""
    ids = session.scalars(
        select(RunRow.id).where(RunRow.status == RunStatus.queued).order_by(RunRow.id)
    )
    return {run_id: place for place, run_id in enumerate(ids, start=1)}


def followed_run(session: Session, *, source: RunSource, key: str, folder: str) -> RunRow | None:
    """The newest run of `source` whose config[key] is `folder` (the run a follower resumes)."""
    runs = session.scalars(select(RunRow).where(RunRow.source == source).order_by(RunRow.id.desc()))
    return next((run for run in runs if (run.config or {}).get(key) == folder), None)


CALLBACK_CONFIG = "rollout_lens"  # the callback's own facts in a run's config (its run key too)


def callback_run(session: Session, *, key: str) -> RunRow | None:
    """The run a script's RolloutLensCallback recorded locally under `key` (its config says it):
    the run a script resumed from its checkpoint continues. Newest first; resumes are rare."""
    runs = session.execute(
        select(RunRow.id, RunRow.config)
        .where(RunRow.source == RunSource.callback)
        .order_by(RunRow.id.desc())
    )
    for run_id, config in runs:
        facts = (config or {}).get(CALLBACK_CONFIG)
        if isinstance(facts, dict) and facts.get("key") == key:
            return session.get(RunRow, run_id)
    return None


def mark_following(session: Session, *, run_id: int, worker_host: str) -> None:
    """A follower (`import-verl --follow`, `import-trl --follow`) records the run from now on."""
    run = get_run(session, run_id=run_id)
    now = utcnow()
    run.status = RunStatus.running
    run.worker_host = worker_host
    run.started_at = run.started_at or now
    run.heartbeat_at = now
    run.finished_at = None
    run.error = None
    run.ended_by = None
    run.cancel_requested = False
    session.flush()


def restore_run_columns(session: Session, *, run_id: int, values: dict[str, Any]) -> None:
    """Set a run's columns as an exported copy had them (an import, after its steps)."""
    if values:
        session.execute(update(RunRow).where(RunRow.id == run_id).values(**values))


# --- runs recorded over HTTP (/api/record) -----------------------------------------------------


def recorded_run(session: Session, *, key: str) -> RunRow | None:
    """The run a recorder created under `key` (its retried create finds it), or None."""
    return session.scalars(select(RunRow).where(RunRow.record_key == key)).first()


def set_record_owner(session: Session, *, run_id: int, key: str, recorded_by: str | None) -> None:
    """A run created by a recorder over HTTP: its key and the token that may write to it."""
    session.execute(
        update(RunRow).where(RunRow.id == run_id).values(record_key=key, recorded_by=recorded_by)
    )


def present_steps(session: Session, *, run_id: int, steps: Sequence[int]) -> set[int]:
    """Which of `steps` the run has recorded already (a retry after a lost answer)."""
    if not steps:
        return set()
    rows = session.scalars(
        select(StepRow.step).where(StepRow.run_id == run_id, StepRow.step.in_(sorted(set(steps))))
    )
    return set(rows)


def revive(session: Session, *, run_id: int) -> None:
    """A recorder heard from again after the sweeper marked its run lost: running again (a run
    lost by its recorder's own finish stays lost)."""
    session.execute(
        update(RunRow)
        .where(RunRow.id == run_id, ending.REVIVABLE)
        .values(
            status=RunStatus.running,
            finished_at=None,
            error=None,
            ended_by=None,
            heartbeat_at=utcnow(),
        )
    )
