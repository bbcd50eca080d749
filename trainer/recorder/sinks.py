"""Where a StepWriter's steps go (trainer/recorder/writer.py): a Sink, and the database's.

A sink creates (or continues) its run, writes steps, beats the run's heartbeat and finishes the
run; the writer owns everything else (the thread, the steps waiting, the budget, the drops, the
retries). A sink raises SinkAway when its store cannot be reached now, RunEnded when the run
ended elsewhere, OutOfTime when close's deadline has passed, anything else to stop recording.
The dashboard's recording API is trainer/recorder/remote.py's HttpSink.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from rollout_lens.server import store
from rollout_lens.server.core.errors import RunEnded, StepRefused
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store import ending
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import RunStatus
from rollout_lens.trainer.recorder.reading import StepReader, StepUnread
from rollout_lens.trainer.recorder.writer import RunSpec, SinkAway, Wrote, is_transient, short
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("rollout_lens")

Drops = tuple[int, int]  # (steps, rollouts) dropped so far


class Sink(Protocol):
    """A run's store, as the StepWriter's thread uses it (every call on that thread)."""

    away: str  # what the logs say is away ("the database")
    final_seconds: float  # what the run's end may take past close's deadline
    deadline: float | None  # close's deadline (time.monotonic()): requests wait until then
    run_id: int | None  # None until `open` has created the run

    def start(self) -> None:
        """Get ready, without reaching the store or creating the run: the writer's thread calls
        it as it starts (a writer process's imports begin before the first step's write)."""

    def open(self) -> None:
        """Reach the store, and create (or continue) the run if it does not exist yet."""

    def write(self, records: Sequence[StepRecord], drops: Drops) -> Wrote:
        """Write the oldest waiting steps in order (as many as the sink takes at once)."""

    def report_drops(self, drops: Drops) -> None:
        """Put the drop counts on the run, if they changed since the store last heard them."""

    def heartbeat(self) -> None:
        """The run is alive (and, for a script's run, not cancelled: else RunEnded)."""

    def finish(self, status: RunStatus, error: str | None, drops: Drops, *, late: bool) -> None:
        """Mark the run ended (a script's; `late`: after close's deadline); never raises."""

    def forget(self) -> None:
        """Steps left the writer unwritten: what was made of the steps waiting is stale."""

    def close(self) -> None:
        """Let go of connections (the writer thread ends)."""


def read_steps(
    reader: StepReader | None, records: Sequence[StepRecord]
) -> tuple[list[StepRecord], StepUnread | None]:
    """`records` with the judged steps among them read by `reader` (StepReader.complete): up to
    the first that cannot be read, and why it could not (a StepUnread; None: all were)."""
    if reader is None:
        return list(records), None
    read: list[StepRecord] = []
    for record in records:
        try:
            read.append(reader.complete(record))
        except Exception as exc:  # noqa: BLE001 - a bad step must not stop the others
            return read, StepUnread(f"could not prepare step {record.step}: {short(exc)}")
    return read, None


def reads_steps(writer: Any, reader: StepReader) -> bool:
    """Whether `writer` (a StepWriter made elsewhere: a launched run's) writes to a database
    sink, which then reads the judged steps it is handed with `reader` where it writes them:
    on the writer's thread, or in its process (sink_process.ProcessSink), not on the training
    thread, which judges them."""
    sink = getattr(writer, "sink", None)
    if isinstance(sink, SqlSink):
        sink.reader = reader
        return True
    take_reader = getattr(sink, "take_reader", None)
    if take_reader is None:  # e.g. a remote sink: steps are read before they travel
        return False
    take_reader(reader)
    return True


class SqlSink:
    """The database, through the store's one writer (store.RunWriter). A script's run is
    created here (or continued: `resume`) and held alive while steps are written; a launched
    run's is the worker's (`launched`: it heartbeats, marks and watches for a cancel)."""

    away = "the database"
    final_seconds = 0.0  # a database that did not answer in time: the sweeper marks it lost

    def __init__(
        self,
        *,
        factory: sessionmaker[Session] | None,
        database_url: str | None = None,
        run_id: int | None = None,
        spec: RunSpec | None = None,
        control_tokens: list[str],
        price_per_hour: float = 0.0,
        busy_timeout_ms: int = 30_000,
        resume: tuple[str, int] | None = None,
        reader: StepReader | None = None,
    ) -> None:
        if (factory is None) == (database_url is None):
            raise ValueError("SqlSink needs a session factory or a database URL (one of them)")
        if (run_id is None) == (spec is None):
            raise ValueError("SqlSink needs a run id or a RunSpec to create one (one of them)")
        self.run_id = run_id
        self.spec = spec
        self.launched = spec is None
        self.database_url = database_url
        self.control_tokens = control_tokens
        self.price = price_per_hour
        self.busy_timeout_ms = busy_timeout_ms
        self.resume = resume
        self.reader = reader  # reads the judged steps a script's writer hands over
        self.deadline: float | None = None
        self._factory = factory
        self._engine: Engine | None = None  # ours to dispose (made from database_url)
        self._run_writer: store.RunWriter | None = None  # the store's, once the run exists
        self._uncertain = False  # a commit failed midway: it may have landed
        self._reported_drops: Drops = (0, 0)

    @classmethod
    def of_url(
        cls,
        database_url: str,
        *,
        spec: RunSpec,
        price_per_hour: float,
        busy_timeout_ms: int,
        resume: tuple[str, int] | None,
        reader: StepReader | None = None,
    ) -> SqlSink:
        """A user's script's run, created (or continued: `resume`) at `database_url`; its judged
        steps read here by `reader`."""
        return cls(
            factory=None,
            database_url=database_url,
            spec=spec,
            control_tokens=list(spec.control_tokens),
            price_per_hour=price_per_hour,
            busy_timeout_ms=busy_timeout_ms,
            resume=resume,
            reader=reader,
        )

    @classmethod
    def of_launched(
        cls,
        factory: sessionmaker[Session],
        *,
        run_id: int,
        control_tokens: list[str],
        price_per_hour: float,
    ) -> SqlSink:
        """A launched run's (the worker's run row, heartbeat and end)."""
        return cls(
            factory=factory,
            run_id=run_id,
            control_tokens=list(control_tokens),
            price_per_hour=price_per_hour,
        )

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        """Connection trouble (a transient DBAPIError, a disk that went away) as SinkAway."""
        try:
            yield
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            raise SinkAway(short(exc)) from exc
        except OSError as exc:  # e.g. a SQLite file on a disk that went away
            raise SinkAway(short(exc)) from exc

    def start(self) -> None:
        pass  # nothing to start: the store is reached at `open`

    def open(self) -> None:
        with self._reaching():
            factory = self._connect()
            if self.run_id is None:
                self._create_run(factory)

    def _connect(self) -> sessionmaker[Session]:
        if self._factory is None:
            from rollout_lens.server.store.migrate import upgrade

            assert self.database_url is not None
            engine = make_engine(self.database_url, busy_timeout_ms=self.busy_timeout_ms)
            try:
                upgrade(engine)
            except Exception:
                engine.dispose()
                raise
            self._engine, self._factory = engine, make_session_factory(engine)
        return self._factory

    def _create_run(self, factory: sessionmaker[Session]) -> None:
        spec = self.spec
        assert spec is not None
        if self.resume is not None and self._resume_run(factory, *self.resume):
            return
        with session_scope(factory) as session:
            run = store.create_run(
                session,
                name=spec.name,
                model=spec.model,
                total_steps=spec.total_steps,
                group_size=spec.group_size,
                prompts_per_step=spec.prompts_per_step,
                seed=spec.seed,
                config=spec.config,
                control_tokens=spec.control_tokens,
                status=RunStatus.running,
                source=spec.source,
                notes=spec.notes,
                keep_tokens_every=spec.keep_tokens_every,
            )
            store.mark_running(
                session,
                run_id=run.id,
                worker_host=socket.gethostname(),
                device=spec.device,
                control_tokens=spec.control_tokens,
            )
            self.run_id = run.id
        log.info("Rollout Lens: recording run %d (%s)", self.run_id, spec.name)

    def _resume_run(self, factory: sessionmaker[Session], key: str, after_step: int) -> bool:
        """Continue the run created under `key` from the checkpoint at `after_step`; False when
        this database has no such run (the script's run is recorded elsewhere: a new one)."""
        assert self.spec is not None
        with session_scope(factory) as session:
            run = store.callback_run(session, key=key)
            if run is None:
                log.warning(
                    "Rollout Lens: the run this checkpoint was recorded in is not in this "
                    "database: recording a new run from step %d",
                    after_step,
                )
                return False
            store.resume_run(
                session,
                run_id=run.id,
                after_step=after_step,
                worker_host=socket.gethostname(),
                device=self.spec.device,
            )
            self.run_id = run.id
        log.info("Rollout Lens: run %d continues from step %d", self.run_id, after_step)
        return True

    def write(self, records: Sequence[StepRecord], drops: Drops) -> Wrote:
        """The steps in one transaction. A refused batch is written one step at a time to find
        the step the database refuses or already has (a commit whose answer was lost). After a
        try that failed on the way (its commit may have landed, its answer lost), the steps the
        run has already are found first and taken as written: written again, the first of
        them is refused before any insert (out of order, or its rollouts recorded already).
        Judged steps are read first: one that cannot be read is refused alone (dropped), the
        steps before it written."""
        records, unread = read_steps(self.reader, records)
        if unread is not None and not records:
            return Wrote(taken=0, written=0, refused=unread)
        with self._reaching():
            landed = self._landed(records) if self._uncertain else 0
            if landed:
                log.info(
                    "Rollout Lens: step(s) %d-%d were already written",
                    records[0].step,
                    records[landed - 1].step,
                )
                self._uncertain = False
                return Wrote(taken=landed, written=0, records=records)
            try:
                self._commit(records)
            except (StepRefused, DBAPIError) as exc:
                if len(records) == 1 or (isinstance(exc, DBAPIError) and is_transient(exc)):
                    return self._settle(records[0], exc)
                try:  # find the step at fault: the next call goes on with the others
                    self._commit(records[:1])
                except (StepRefused, DBAPIError) as single:
                    return self._settle(records[0], single)
                records = records[:1]
        self._uncertain = False
        return Wrote(taken=len(records), written=len(records), records=records)

    def _landed(self, records: Sequence[StepRecord]) -> int:
        """How many of the first `records` the run has already (a commit whose answer was
        lost)."""
        assert self.run_id is not None and self._factory is not None
        with session_scope(self._factory) as session:
            present = store.present_steps(
                session, run_id=self.run_id, steps=[r.step for r in records]
            )
        return next((i for i, r in enumerate(records) if r.step not in present), len(records))

    def _settle(self, record: StepRecord, exc: StepRefused | DBAPIError) -> Wrote:
        """A step the database would not take: retry later (raised), already there, or
        refused."""
        if isinstance(exc, DBAPIError) and is_transient(exc):
            self._uncertain = True
            raise exc
        if isinstance(exc, IntegrityError) and (self._uncertain or not self.launched):
            # The step is there already: a commit whose answer the connection lost. Not twice.
            log.info("Rollout Lens: step %d was already written", record.step)
            self._uncertain = False
            return Wrote(taken=1, written=0)
        return Wrote(taken=0, written=0, refused=exc)  # out of order, RolloutsTaken, a bad row

    def _commit(self, records: Sequence[StepRecord]) -> None:
        assert self.run_id is not None and self._factory is not None
        if self._run_writer is None:
            self._run_writer = store.RunWriter(
                self.run_id, control_tokens=self.control_tokens, price_per_hour=self.price
            )
        # A script's run: its row is held first, RunEnded once it was cancelled from the
        # dashboard (a launched run's worker asks about a cancel: trainer/worker/monitor.py).
        alive = functools.partial(ending.recorder_alive, run_id=self.run_id)
        guard = None if self.launched else alive
        self._run_writer.commit(self._factory.kw["bind"], list(records), guard=guard)

    def report_drops(self, drops: Drops) -> None:
        if drops == self._reported_drops or self.run_id is None or self._factory is None:
            return
        with self._reaching(), session_scope(self._factory) as session:
            store.set_dropped(session, run_id=self.run_id, steps=drops[0], rollouts=drops[1])
        self._reported_drops = drops

    def heartbeat(self) -> None:
        if self.run_id is None or self._factory is None:
            return
        with self._reaching(), session_scope(self._factory) as session:
            if self.launched:
                store.heartbeat(session, run_id=self.run_id)
            else:  # a cancel is heard between slow steps too
                ending.recorder_alive(session, run_id=self.run_id)

    def finish(self, status: RunStatus, error: str | None, drops: Drops, *, late: bool) -> None:
        """A script's run is ours to mark finished (the worker marks launched runs); after
        close's deadline nothing (the database did not answer in time: a run whose heartbeats
        stop is marked lost by the dashboard's sweeper)."""
        if late or self.launched or self._factory is None or self.run_id is None:
            return
        try:
            with session_scope(self._factory) as session:
                ending.finish_recorded(session, run_id=self.run_id, status=status, error=error)
        except RunEnded as exc:  # cancelled from the dashboard since the last write: it stays
            log.warning("Rollout Lens: %s", exc)
        except Exception as exc:  # noqa: BLE001 - nothing left to do but say so
            log.warning("Rollout Lens: could not mark run %s finished: %s", self.run_id, exc)

    def forget(self) -> None:
        pass  # nothing is made of the steps before they are written

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
