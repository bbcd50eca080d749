"""All SQL of Rollout Lens: keyword-only functions over a Session (routes → store → models)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from rollout_lens.server.errors import InvalidState, NotFound
from rollout_lens.server.models import (
    ROLLUP_WIDTHS,
    Metric,
    Prompt,
    Rollout,
    Run,
    RunSource,
    RunStatus,
    SeriesRollup,
    Step,
    utcnow,
)
from rollout_lens.server.packing import pack_floats, pack_ints, pack_matrix
from rollout_lens.server.records import RolloutRecord, StepRecord
from rollout_lens.server.series import STEP_SERIES, WINDOW
from sqlalchemy import CursorResult, delete, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

RESUMABLE_STATUSES = (RunStatus.lost, RunStatus.failed, RunStatus.cancelled)


def _insert(session: Session, table: Any) -> Any:
    """A dialect insert that supports ON CONFLICT DO NOTHING (SQLite and PostgreSQL)."""
    dialect = session.get_bind().dialect.name
    return pg_insert(table) if dialect == "postgresql" else sqlite_insert(table)


def _finite(value: float | None) -> float | None:
    """NaN and infinities are stored as NULL: neither JSON nor a chart can show them."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


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
) -> Run:
    """Insert a run and return it with its id."""
    run = Run(
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
    )
    session.add(run)
    session.flush()
    return run


def get_run(session: Session, *, run_id: int) -> Run:
    """The run, or NotFound."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    return run


def list_runs(session: Session, *, limit: int | None = None) -> list[Run]:
    """Runs, newest first."""
    query = select(Run).order_by(Run.id.desc())
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query))


def mark_running(
    session: Session, *, run_id: int, worker_host: str, device: str, control_tokens: Sequence[str]
) -> None:
    """The run has started training on `device`."""
    now = utcnow()
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(
            status=RunStatus.running,
            worker_host=worker_host,
            device=device,
            control_tokens=list(control_tokens),
            started_at=now,
            heartbeat_at=now,
            error=None,
        )
    )


def mark_finished(
    session: Session, *, run_id: int, status: RunStatus, error: str | None = None
) -> None:
    """The run has ended as completed, failed, cancelled or lost."""
    session.execute(
        update(Run).where(Run.id == run_id).values(status=status, finished_at=utcnow(), error=error)
    )


def add_device_time(
    session: Session, *, run_id: int, seconds: float, price_per_hour: float
) -> None:
    """Account device time and its estimated cost on the run."""
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(
            device_seconds=Run.device_seconds + seconds,
            cost=Run.cost + seconds / 3600.0 * price_per_hour,
            heartbeat_at=utcnow(),
        )
    )


def set_dropped(session: Session, *, run_id: int, steps: int, rollouts: int) -> None:
    """What a recorder had to drop (the database away longer than its buffer lasted)."""
    session.execute(
        update(Run).where(Run.id == run_id).values(dropped_steps=steps, dropped_rollouts=rollouts)
    )


# --- writing a step -----------------------------------------------------------------------------


def intern_prompts(session: Session, texts: Iterable[str]) -> dict[str, int]:
    """Store each distinct prompt text once; return text → prompt id."""
    by_hash = {hashlib.sha256(t.encode()).hexdigest(): t for t in set(texts)}
    if not by_hash:
        return {}
    session.execute(
        _insert(session, Prompt)
        .values([{"sha256": h, "text": t} for h, t in by_hash.items()])
        .on_conflict_do_nothing(index_elements=["sha256"])
    )
    rows = session.execute(select(Prompt.sha256, Prompt.id).where(Prompt.sha256.in_(by_hash)))
    return {by_hash[h]: pid for h, pid in rows}


def record_step(
    session: Session,
    *,
    run_id: int,
    record: StepRecord,
    control_tokens: Sequence[str],
    recorded_at: datetime | None = None,
) -> None:
    """Write one step, its rollouts and extra series, and refresh the run's summary columns.

    The caller's session scope makes this one transaction. `recorded_at` defaults to now (an
    import passes the original time).
    """
    values = {name: _finite(record.values.get(name)) for name in STEP_SERIES}
    step_row = Step(run_id=run_id, step=record.step, rollout_step=record.rollout_step, **values)
    if recorded_at is not None:
        step_row.recorded_at = recorded_at
    session.add(step_row)
    add_rollouts(
        session,
        run_id=run_id,
        step=record.rollout_step,
        rollouts=record.rollouts,
        control_tokens=control_tokens,
    )
    if record.metrics:
        session.execute(
            _insert(session, Metric),
            [
                {"run_id": run_id, "step": record.step, "name": name, "value": _finite(value)}
                for name, value in record.metrics.items()
            ],
        )
    rollup_values = {name: v for name, v in values.items() if v is not None}
    rollup_values.update(
        {
            name: v
            for name, v in ((n, _finite(x)) for n, x in record.metrics.items())
            if v is not None
        }
    )
    _roll_up(session, run_id=run_id, step=record.step, values=rollup_values)
    _refresh_summary(session, run_id=run_id, step=record.step)


def add_rollouts(
    session: Session,
    *,
    run_id: int,
    step: int,
    rollouts: Sequence[RolloutRecord],
    control_tokens: Sequence[str],
) -> None:
    """Write rollouts generated at `step` (record_step calls it; an import calls it alone)."""
    if not rollouts:
        return
    prompt_ids = intern_prompts(session, (r.prompt for r in rollouts))
    session.execute(
        _insert(session, Rollout),
        [
            {
                "run_id": run_id,
                "step": step,
                "group": r.group,
                "index": r.index,
                "prompt_id": prompt_ids[r.prompt],
                "target": r.target,
                "completion": r.completion,
                "vote": r.vote,
                "verifier_reward": float(r.verifier_reward),
                "true_score": _finite(r.true_score),
                "advantage": float(r.advantage),
                "sum_logprob": r.sum_logprob,
                "format_valid": bool(r.format_valid),
                "format_state": r.format_state,
                "completion_ids": pack_ints(r.completion_ids),
                "token_logprobs": pack_floats(r.token_logprobs),
                "control_probs": pack_matrix(
                    [r.control_probs.get(t, [0.0] * len(r.completion_ids)) for t in control_tokens]
                ),
                "meta": r.meta,
            }
            for r in rollouts
        ],
    )


def _least_greatest(session: Session) -> tuple[Any, Any]:
    """Two-argument min and max: SQLite's scalar min()/max(), PostgreSQL's least()/greatest()."""
    if session.get_bind().dialect.name == "sqlite":
        return func.min, func.max
    return func.least, func.greatest


def _roll_up(session: Session, *, run_id: int, step: int, values: dict[str, float]) -> None:
    """Fold one step's values into each rollup width's bucket (one upsert statement)."""
    if not values:
        return
    least, greatest = _least_greatest(session)
    rows = [
        {
            "run_id": run_id,
            "name": name,
            "width": width,
            "bucket": (step - 1) // width,
            "n": 1,
            "total": value,
            "lo": value,
            "hi": value,
            "first_step": step,
            "last_step": step,
        }
        for name, value in values.items()
        for width in ROLLUP_WIDTHS
    ]
    table = SeriesRollup.__table__
    statement = _insert(session, SeriesRollup)
    new = statement.excluded
    # executemany of one cached statement: a multi-row VALUES of ~300 rows is recompiled every
    # step and cost ~115 ms of Python per step, on the writer thread but under the GIL.
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["run_id", "name", "width", "bucket"],
            set_={
                "n": table.c.n + new.n,
                "total": table.c.total + new.total,
                "lo": least(table.c.lo, new.lo),
                "hi": greatest(table.c.hi, new.hi),
                "first_step": least(table.c.first_step, new.first_step),
                "last_step": greatest(table.c.last_step, new.last_step),
            },
        ),
        rows,
    )


def _rebuild_rollups(session: Session, *, run_id: int, after_step: int) -> None:
    """Recompute the rollup buckets that held steps after `after_step` from the raw rows left."""
    columns = [
        "run_id",
        "name",
        "width",
        "bucket",
        "n",
        "total",
        "lo",
        "hi",
        "first_step",
        "last_step",
    ]
    for width in ROLLUP_WIDTHS:
        first_bucket = after_step // width
        session.execute(
            delete(SeriesRollup).where(
                SeriesRollup.run_id == run_id,
                SeriesRollup.width == width,
                SeriesRollup.bucket >= first_bucket,
            )
        )
        lowest = first_bucket * width + 1
        bucket = (Step.step - 1) // width
        for name in STEP_SERIES:
            column = getattr(Step, name)
            source = (
                select(
                    Step.run_id,
                    literal(name),
                    literal(width),
                    bucket,
                    func.count(column),
                    func.sum(column),
                    func.min(column),
                    func.max(column),
                    func.min(Step.step),
                    func.max(Step.step),
                )
                .where(Step.run_id == run_id, Step.step >= lowest, column.is_not(None))
                .group_by(Step.run_id, bucket)
            )
            session.execute(insert(SeriesRollup).from_select(columns, source))
        metric_bucket = (Metric.step - 1) // width
        source = (
            select(
                Metric.run_id,
                Metric.name,
                literal(width),
                metric_bucket,
                func.count(Metric.value),
                func.sum(Metric.value),
                func.min(Metric.value),
                func.max(Metric.value),
                func.min(Metric.step),
                func.max(Metric.step),
            )
            .where(Metric.run_id == run_id, Metric.step >= lowest, Metric.value.is_not(None))
            .group_by(Metric.run_id, Metric.name, metric_bucket)
        )
        session.execute(insert(SeriesRollup).from_select(columns, source))


def rollup_series(
    session: Session, *, run_id: int, names: Sequence[str], width: int, since: int = 0
) -> dict[str, list[tuple[int, int, int, float, float, float]]]:
    """Buckets of `width` steps: name → [(first_step, last_step, n, mean, lo, hi)] by step.

    Buckets that end after `since` are returned whole, so a live chart can replace the bucket it
    last drew.
    """
    query = (
        select(
            SeriesRollup.name,
            SeriesRollup.first_step,
            SeriesRollup.last_step,
            SeriesRollup.n,
            SeriesRollup.total,
            SeriesRollup.lo,
            SeriesRollup.hi,
        )
        .where(
            SeriesRollup.run_id == run_id,
            SeriesRollup.width == width,
            SeriesRollup.name.in_(names),
            SeriesRollup.last_step > since,
        )
        .order_by(SeriesRollup.name, SeriesRollup.bucket)
    )
    out: dict[str, list[tuple[int, int, int, float, float, float]]] = {}
    for name, first, last, n, total, lo, hi in session.execute(query):
        out.setdefault(name, []).append((first, last, n, total / n, lo, hi))
    return out


def _refresh_summary(session: Session, *, run_id: int, step: int) -> None:
    """Keep current_step and the last-25-step means on the run row (reads ≤ 25 indexed rows)."""
    recent = (
        select(Step.true_accuracy, Step.reward_mean)
        .where(Step.run_id == run_id)
        .order_by(Step.step.desc())
        .limit(WINDOW)
        .subquery()
    )
    acc, reward = session.execute(
        select(func.avg(recent.c.true_accuracy), func.avg(recent.c.reward_mean))
    ).one()
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(
            current_step=func.max(Run.current_step, step)
            if session.get_bind().dialect.name == "sqlite"
            else func.greatest(Run.current_step, step),
            recent_true_accuracy=acc,
            recent_reward=reward,
            heartbeat_at=utcnow(),
        )
    )


def last_step(session: Session, *, run_id: int) -> int:
    """The highest recorded step of a run (0 when none)."""
    value = session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id))
    return int(value or 0)


# --- reading ------------------------------------------------------------------------------------


def steps(session: Session, *, run_id: int, since: int = 0) -> list[Step]:
    """Steps of a run after `since`, in order."""
    query = select(Step).where(Step.run_id == run_id, Step.step > since).order_by(Step.step)
    return list(session.scalars(query))


def step_rollouts(session: Session, *, run_id: int, step: int) -> list[tuple[Rollout, str]]:
    """The rollouts the update at `step` trained on, with their prompt text, in group order."""
    rollout_step = session.scalar(
        select(Step.rollout_step).where(Step.run_id == run_id, Step.step == step)
    )
    query = (
        select(Rollout, Prompt.text)
        .join(Prompt, Prompt.id == Rollout.prompt_id)
        .where(Rollout.run_id == run_id, Rollout.step == (rollout_step or step))
        .order_by(Rollout.group, Rollout.index)
    )
    return [(r, text) for r, text in session.execute(query)]


def iter_rollouts(
    session: Session, *, run_id: int, batch: int = 500
) -> Iterator[tuple[Rollout, str]]:
    """Every rollout of a run with its prompt text, by step, group and index (streamed)."""
    query = (
        select(Rollout, Prompt.text)
        .join(Prompt, Prompt.id == Rollout.prompt_id)
        .where(Rollout.run_id == run_id)
        .order_by(Rollout.step, Rollout.group, Rollout.index)
        .execution_options(yield_per=batch)
    )
    yield from session.execute(query)  # rows unpack like (rollout, prompt text)


def metric_series(
    session: Session, *, run_id: int, names: Sequence[str] | None = None, since: int = 0
) -> dict[str, list[tuple[int, float | None]]]:
    """Generic series of a run after `since`: name → [(step, value)] ordered by step."""
    query = select(Metric.name, Metric.step, Metric.value).where(
        Metric.run_id == run_id, Metric.step > since
    )
    if names is not None:
        query = query.where(Metric.name.in_(names))
    out: dict[str, list[tuple[int, float | None]]] = {}
    for name, step, value in session.execute(query.order_by(Metric.name, Metric.step)):
        out.setdefault(name, []).append((step, value))
    return out


def heartbeat(session: Session, *, run_id: int, at: datetime | None = None) -> None:
    """The worker training this run is alive."""
    session.execute(update(Run).where(Run.id == run_id).values(heartbeat_at=at or utcnow()))


# --- launch, cancel, resume, liveness ----------------------------------------------------------


def claim_run(session: Session, *, run_id: int, task_id: str) -> bool:
    """Atomically take a queued run for one task; False if another delivery already has it."""
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == RunStatus.queued)
        .values(status=RunStatus.running, task_id=task_id, heartbeat_at=utcnow())
    )
    return cast(CursorResult[Any], result).rowcount == 1


def set_task_id(session: Session, *, run_id: int, task_id: str) -> None:
    """Remember which broker task will train the run."""
    session.execute(update(Run).where(Run.id == run_id).values(task_id=task_id))


def request_cancel(session: Session, *, run_id: int) -> str:
    """Cancel a queued run now, or ask a running one to stop; returns the resulting status."""
    run = get_run(session, run_id=run_id)
    if run.status == RunStatus.queued:
        mark_finished(session, run_id=run_id, status=RunStatus.cancelled)
        return RunStatus.cancelled
    if run.status == RunStatus.running:
        session.execute(update(Run).where(Run.id == run_id).values(cancel_requested=True))
        return RunStatus.running
    raise InvalidState(
        f"run {run_id} is {run.status}: only queued or running runs can be cancelled"
    )


def cancel_requested(session: Session, *, run_id: int) -> bool:
    """Whether someone asked the run to stop."""
    return bool(session.scalar(select(Run.cancel_requested).where(Run.id == run_id)))


def requeue_for_resume(session: Session, *, run_id: int) -> Run:
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
    return run


def set_checkpoint(session: Session, *, run_id: int, step: int) -> None:
    """Every step up to `step` is recorded and a checkpoint of it is on disk."""
    session.execute(update(Run).where(Run.id == run_id).values(checkpoint_step=step))


def truncate_after(session: Session, *, run_id: int, step: int) -> None:
    """Delete what was recorded after `step` (before resuming from a checkpoint at `step`)."""
    for model in (Rollout, Metric, Step):
        session.execute(delete(model).where(model.run_id == run_id, model.step > step))
    _rebuild_rollups(session, run_id=run_id, after_step=step)
    session.execute(update(Run).where(Run.id == run_id).values(current_step=step))
    if step > 0:
        _refresh_summary(session, run_id=run_id, step=step)
    else:
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(recent_true_accuracy=None, recent_reward=None)
        )


def mark_lost_runs(session: Session, *, stale_after: timedelta) -> list[int]:
    """Runs `running` whose worker stopped beating: mark them lost; return their ids."""
    cutoff = utcnow() - stale_after
    ids = list(
        session.scalars(
            select(Run.id).where(Run.status == RunStatus.running, Run.heartbeat_at < cutoff)
        )
    )
    if ids:
        session.execute(
            update(Run)
            .where(Run.id.in_(ids), Run.status == RunStatus.running)
            .values(
                status=RunStatus.lost,
                finished_at=utcnow(),
                error=f"the worker stopped sending heartbeats for over {stale_after.seconds} s",
            )
        )
    return ids


def queue_position(session: Session, *, run_id: int) -> int | None:
    """1 for the next queued run to train, None when the run is not queued."""
    run = get_run(session, run_id=run_id)
    if run.status != RunStatus.queued:
        return None
    ahead = session.scalar(
        select(func.count()).where(Run.status == RunStatus.queued, Run.id < run_id)
    )
    return int(ahead or 0) + 1


# --- launch from the web app (appended) ---------------------------------------------------------


def discard_queued_runs(session: Session, *, run_ids: Sequence[int]) -> list[int]:
    """Delete runs that are still queued (a launch whose enqueue failed); return their ids.

    A run a worker already claimed is left alone: its broker message got through.
    """
    ids = list(
        session.scalars(select(Run.id).where(Run.id.in_(run_ids), Run.status == RunStatus.queued))
    )
    if ids:
        session.execute(delete(Run).where(Run.id.in_(ids)))
    return ids


def restore_status(
    session: Session,
    *,
    run_id: int,
    status: str,
    error: str | None,
    finished_at: datetime | None,
) -> None:
    """Undo requeue_for_resume when the resumed run could not be enqueued (still queued only)."""
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == RunStatus.queued)
        .values(status=status, error=error, finished_at=finished_at)
    )


def queue_positions(session: Session) -> dict[int, int]:
    """Every queued run's place in the queue (1: the next to train), in one query."""
    ids = session.scalars(select(Run.id).where(Run.status == RunStatus.queued).order_by(Run.id))
    return {run_id: place for place, run_id in enumerate(ids, start=1)}


# --- export and import (appended) ---------------------------------------------------------------


def iter_steps(
    session: Session, *, run_id: int, page: int = 500
) -> Iterator[tuple[Step, dict[str, float | None]]]:
    """Every step of a run with its generic series (name → value), in order, read a page of
    steps at a time (keyset paging: memory stays flat however long the run)."""
    after = 0
    while True:
        rows = list(
            session.scalars(
                select(Step)
                .where(Step.run_id == run_id, Step.step > after)
                .order_by(Step.step)
                .limit(page)
            )
        )
        if not rows:
            return
        first, after = rows[0].step, rows[-1].step
        metrics: dict[int, dict[str, float | None]] = {}
        for step, name, value in session.execute(
            select(Metric.step, Metric.name, Metric.value).where(
                Metric.run_id == run_id, Metric.step >= first, Metric.step <= after
            )
        ):
            metrics.setdefault(step, {})[name] = value
        for row in rows:
            yield row, dict(sorted(metrics.get(row.step, {}).items()))


def metric_names(session: Session, *, run_id: int) -> list[str]:
    """Every generic series name a run recorded, sorted."""
    return list(
        session.scalars(
            select(Metric.name).where(Metric.run_id == run_id).distinct().order_by(Metric.name)
        )
    )


def restore_run_columns(session: Session, *, run_id: int, values: dict[str, Any]) -> None:
    """Set a run's columns as an exported copy had them (an import, after its steps)."""
    if values:
        session.execute(update(Run).where(Run.id == run_id).values(**values))
