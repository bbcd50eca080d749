"""The one writer of a run's steps. Every source hands StepRecords to a RunWriter, and every
RunWriter writes them with `write_steps`: a launched run's and a user's script's StepWriter
thread (trainer/recorder/writer.py: its own transaction a batch, `commit`), `rollout-lens
import` of an export, `import-trl`/`import-verl` and their follow mode (the caller's
transaction, `write`).

A RunWriter keeps the store's Recorder (what the run's next write needs) between batches and
drops it with a transaction that does not commit (`reset`): its memory is ahead of the database.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store.models import RunRow
from rollout_lens.server.store.recording import Recorder
from rollout_lens.server.store.runs import restore_run_columns
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

log = logging.getLogger("rollout_lens")


def write_steps(
    conn: Connection,
    recorder: Recorder | None,
    records: Iterable[StepRecord],
    *,
    run_id: int,
    control_tokens: Sequence[str],
    price_per_hour: float = 0.0,
    charge_wall_time: bool = False,
    index: bool = True,
) -> Recorder:
    """THE store function that writes steps: `records` in the caller's transaction, with
    `recorder` (built from the database when None); returns the recorder for the next call.
    `charge_wall_time`: each step's wall time is device time at `price_per_hour` (a run being
    trained); `index`: its rollouts are searchable in this transaction, else at the recorder's
    next `index` (write_batch)."""
    if recorder is None:
        recorder = Recorder(conn, run_id=run_id, control_tokens=control_tokens)
    for record in records:
        seconds = (record.values.get("wall_time") or 0.0) if charge_wall_time else 0.0
        recorder.write(
            conn,
            record,
            recorded_at=record.recorded_at,
            device_seconds=seconds,
            price_per_hour=price_per_hour,
            index=index,
        )
    return recorder


def write_batch(
    engine: Engine,
    recorder: Recorder | None,
    records: Sequence[StepRecord],
    *,
    run_id: int,
    control_tokens: Sequence[str],
    price_per_hour: float,
    guard: Callable[[Connection], None] | None = None,
) -> Recorder:
    """`records` of a run being trained in one transaction of their own (write_steps, each step
    charged its wall time); their rollouts become searchable in a second transaction right
    after the commit (search indexing is a third of a step's write: the steps are safe sooner).
    A crash between the two is mended by the run's next Recorder (search.unindexed).
    `guard` runs first in the transaction and may refuse it by raising (a run that has ended).

    When this raises, the recorder's memory may be ahead of what was committed: the caller
    throws it away and passes None next time."""
    with engine.begin() as conn:
        if guard is not None:
            guard(conn)
        recorder = write_steps(
            conn,
            recorder,
            records,
            run_id=run_id,
            control_tokens=control_tokens,
            price_per_hour=price_per_hour,
            charge_wall_time=True,
            index=False,
        )
    index_written(engine, recorder)
    return recorder


def index_written(engine: Engine, recorder: Recorder) -> None:
    """The committed rollouts `recorder` has not indexed yet, made searchable in their own
    transaction. If that fails they stay waiting on the recorder (its memory still matches the
    database) for its next batch, or for the next recorder after a crash."""
    recorder.index_seconds = 0.0
    if not recorder.unindexed:
        return
    start = time.perf_counter()
    rows = recorder.unindexed
    try:
        with engine.begin() as conn:
            recorder.index(conn)
        recorder.index_seconds = time.perf_counter() - start
    except DBAPIError as exc:
        recorder.index_failed(rows)
        log.warning("Rollout Lens: search indexing of run %d put off: %s", recorder.run_id, exc)


class RunWriter:
    """Writes one run's steps (see the module docstring). `follow_shape`: the run's
    prompts_per_step and total_steps follow the steps written (a trainer's dump folder says
    them as it goes: the alert rules judge shares over the groups a step holds)."""

    def __init__(
        self,
        run_id: int,
        *,
        control_tokens: Sequence[str] = (),
        price_per_hour: float = 0.0,
        follow_shape: bool = False,
        prompts_per_step: int = 1,
        total_steps: int | None = None,
    ) -> None:
        self.run_id = run_id
        self.control_tokens = list(control_tokens)
        self.price_per_hour = price_per_hour
        self.follow_shape = follow_shape
        self.prompts_per_step = prompts_per_step
        self.total_steps = total_steps  # the trainer's planned steps, when told
        self.recorder: Recorder | None = None

    def write(self, session: Session, records: Iterable[StepRecord]) -> tuple[int, int]:
        """Write the steps in the session's transaction; (steps, rollouts) written. After a
        failed transaction call reset()."""
        steps = rollouts = 0
        last = None
        conn = session.connection()
        for record in records:
            if self.follow_shape:
                self._follow_groups(session, record)
            self.recorder = write_steps(
                conn,
                self.recorder,
                [record],
                run_id=self.run_id,
                control_tokens=self.control_tokens,
            )
            steps += 1
            rollouts += len(record.rollouts)
            last = record.step
        if self.follow_shape and last is not None:
            total = max(last, self.total_steps or 0)
            restore_run_columns(session, run_id=self.run_id, values={"total_steps": total})
        _refresh_run(session, self.run_id)
        return steps, rollouts

    def add_rollouts(
        self, session: Session, *, step: int, rollouts: Sequence[RolloutRecord]
    ) -> None:
        """Rollouts generated at `step`, a step written before (an export lists its steps, then
        its rollouts), in the session's transaction."""
        conn = session.connection()
        if self.recorder is None:
            self.recorder = Recorder(conn, run_id=self.run_id, control_tokens=self.control_tokens)
        self.recorder.add_rollouts(conn, step=step, rollouts=rollouts)

    def commit(
        self,
        engine: Engine,
        records: Sequence[StepRecord],
        *,
        guard: Callable[[Connection], None] | None = None,
    ) -> None:
        """Write the steps in one transaction of their own (write_batch, `guard` first); the
        recorder is kept only if it commits."""
        recorder, self.recorder = self.recorder, None
        self.recorder = write_batch(
            engine,
            recorder,
            records,
            run_id=self.run_id,
            control_tokens=self.control_tokens,
            price_per_hour=self.price_per_hour,
            guard=guard,
        )

    def write_charged(self, conn: Connection, records: Sequence[StepRecord]) -> None:
        """`commit`'s write in the caller's transaction (a caller that decides what to write
        under the run's lock, store.lock_run): each step charged its wall time, its rollouts
        searchable once `index_written` runs after the commit. After a failed transaction call
        reset()."""
        self.recorder = write_steps(
            conn,
            self.recorder,
            records,
            run_id=self.run_id,
            control_tokens=self.control_tokens,
            price_per_hour=self.price_per_hour,
            charge_wall_time=True,
            index=False,
        )

    def index_written(self, engine: Engine) -> None:
        """Make the rollouts `write_charged` wrote searchable (write_batch's second half)."""
        if self.recorder is not None:
            index_written(engine, self.recorder)

    def token_texts(self, bind: Engine | Connection) -> dict[int, str]:
        """The run's token texts as its recorder knows them (the recorder built from the
        database first if there is none): a remote recorder sends each token's text once."""
        if self.recorder is None:
            if isinstance(bind, Connection):
                self.recorder = Recorder(
                    bind, run_id=self.run_id, control_tokens=self.control_tokens
                )
            else:
                with bind.connect() as conn:
                    self.recorder = Recorder(
                        conn, run_id=self.run_id, control_tokens=self.control_tokens
                    )
        return self.recorder.token_texts

    def reset(self) -> None:
        """Forget the recorder: its memory is ahead of a transaction that rolled back."""
        self.recorder = None

    def _follow_groups(self, session: Session, record: StepRecord) -> None:
        groups = len({r.group for r in record.rollouts})
        if groups > self.prompts_per_step:
            self.prompts_per_step = groups
            restore_run_columns(session, run_id=self.run_id, values={"prompts_per_step": groups})
            self.recorder = None  # rebuilt from the steps so far, with that number


def _refresh_run(session: Session, run_id: int) -> None:
    """Core writes bypass the session: bring a RunRow it holds up to date."""
    for obj in list(session.identity_map.values()):
        if isinstance(obj, RunRow) and obj.id == run_id:
            session.refresh(obj)


def record_step(
    session: Session,
    *,
    run_id: int,
    record: StepRecord,
    control_tokens: Sequence[str],
    recorded_at: datetime | None = None,
    recorder: Recorder | None = None,
) -> Recorder:
    """Write one step in the session's transaction (write_steps); returns the recorder, which a
    caller writing many steps of the run passes back in (it saves reloading the run's state)."""
    if recorded_at is not None:
        record.recorded_at = recorded_at
    recorder = write_steps(
        session.connection(), recorder, [record], run_id=run_id, control_tokens=control_tokens
    )
    _refresh_run(session, run_id)
    return recorder


def add_rollouts(
    session: Session,
    *,
    run_id: int,
    step: int,
    rollouts: Sequence[RolloutRecord],
    control_tokens: Sequence[str],
) -> None:
    """Write rollouts generated at `step` alone (an import of rollouts without steps)."""
    RunWriter(run_id, control_tokens=control_tokens).add_rollouts(
        session, step=step, rollouts=rollouts
    )
