"""The one writer: every recorded step reaches the database through a StepWriter.

Steps are written off the training thread, in order, by a daemon thread; the steps waiting when
it wakes share one transaction (up to BATCH_STEPS; one step each when training is slower than
writing), through the store's one writer (store.RunWriter: the same as every import's), which
keeps what the next write needs between batches and drops it with a batch that does not commit. A step is written once: a
batch the database took but whose answer the connection lost is recognised on the retry by its
keys (IntegrityError). Connection trouble (`is_transient`) is retried with backoff.

What differs between runs is what to do while the database is away, a policy:

- BufferAndDrop, a user's TRL script (RolloutLensCallback): `put` never blocks and never
  raises. Steps wait in memory up to a byte budget; past it the oldest steps lose their rollouts
  first (their per-step values are kept), then whole steps go; a step the database refuses, or
  whose preparation raises, is dropped alone. What was dropped is counted on the run, problems
  are logged once, and training goes on whatever happens. The writer creates the run row when
  the database first answers, beats its heartbeat and marks it finished at `close`. A run that
  ended elsewhere (cancelled from the dashboard: server/store/ending.py) records nothing more:
  what waits is dropped, and on a cancel `stop_requested` tells the callback to stop training.
- WaitThenFail, a run launched from the dashboard (the worker owns the run row, its heartbeat
  and its end): steps are prepared on the training thread, at most `max_pending` wait (then
  `put` blocks: training pauses), a database that stays away longer than `give_up_after`
  seconds (ROLLOUT_LENS_LOST_AFTER_SECONDS: the dashboard calls a silent worker lost then too)
  or a step it refuses fails the run: the error is raised on the training thread at the next
  `put`, `flush` or `close`, so a run never trains on while its records are lost and the
  recorded steps never have a gap.
"""

from __future__ import annotations

import functools
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollout_lens.server import store
from rollout_lens.server.core.errors import RunEnded, StepRefused
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store import ending
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import RunSource, RunStatus, dashboard_caller
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("rollout_lens")

BATCH_STEPS = 32  # steps written per transaction (a backlog drains in few commits)
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 15.0
FINISH_GIVE_UP_SECONDS = 60.0  # at least: a run's end (and why) is worth waiting for

T = TypeVar("T")


@dataclass(frozen=True)
class BufferAndDrop:
    """A user's script: never stop training; keep at most `max_bytes` of steps in memory."""

    max_bytes: int = 256 * 2**20


@dataclass(frozen=True)
class WaitThenFail:
    """A launched run: pause training while the database is away, fail after `give_up_after`."""

    give_up_after: float = 60.0
    max_pending: int = 64


Policy = BufferAndDrop | WaitThenFail


@dataclass
class RunSpec:
    """What the run row says about a run the writer creates (a user's script)."""

    name: str
    model: str
    total_steps: int
    group_size: int
    prompts_per_step: int
    seed: int
    config: dict[str, Any]
    control_tokens: list[str]
    device: str
    source: RunSource = RunSource.callback
    notes: list[str] = field(default_factory=list)
    keep_tokens_every: int | None = None


class DatabaseAway(RuntimeError):
    """The database stayed unreachable (or unwritable) for longer than the caller waits."""


@dataclass
class Pending:
    record: StepRecord
    size: int  # approximate bytes held


# A token's text as a Python str in a list: an 8-byte pointer plus the object, ~49 bytes and its
# characters. The numbers are numpy arrays (8 bytes a value): at 512 rollouts × 1,024 tokens × 4
# control tokens a step holds ~25 MB of them, where the Python lists it once was took ~140 MB.
_TEXT = 8 + 49


def record_size(record: StepRecord) -> int:
    """Approximate bytes a step holds in memory (dominated by its rollouts' arrays and token
    texts)."""
    size = 200 + 40 * (len(record.values) + len(record.metrics))
    for r in record.rollouts:
        size += 300 + len(r.completion) + len(r.prompt) // 8  # prompts are shared between rollouts
        size += r.completion_ids.nbytes + r.token_logprobs.nbytes
        control = r.control_probs
        size += control.array.nbytes
        if r.tokens:
            size += len(r.tokens) * _TEXT + sum(map(len, r.tokens))
    return size


def _identity(raw: Any) -> StepRecord:
    assert isinstance(raw, StepRecord)
    return raw


class StepWriter:
    """Steps to the database on a daemon thread, under a BufferAndDrop or WaitThenFail policy.

    Make one with `StepWriter.for_script` (creates its run) or `StepWriter.for_launched` (writes
    into the worker's run). `prepare` turns what `put` is handed into a StepRecord.
    (trainer/recorder/remote.py's RemoteStepWriter is the same writer with a dashboard's HTTP
    API where the database is.)
    """

    AWAY = "the database"  # what the logs say is away
    FINAL_SECONDS = 0.0  # what the run's end may take past close's timeout (RemoteStepWriter)

    def __init__(
        self,
        *,
        policy: Policy,
        factory: sessionmaker[Session] | None = None,
        database_url: str | None = None,
        run_id: int | None = None,
        spec: RunSpec | None = None,
        control_tokens: list[str] | None = None,
        prepare: Callable[[Any], StepRecord] = _identity,
        price_per_device_hour: float = 0.0,
        heartbeat_seconds: float | None = None,
        on_written: Callable[[StepRecord], None] | None = None,
        busy_timeout_ms: int = 30_000,
        resume: tuple[str, int] | None = None,
    ) -> None:
        """`resume`: (the key the run was created under, the checkpoint's step) of a script
        resumed from a checkpoint: the run is continued (store.resume_run), not created."""
        if (factory is None) == (database_url is None):
            raise ValueError("StepWriter needs a session factory or a database URL (one of them)")
        if (run_id is None) == (spec is None):
            raise ValueError("StepWriter needs a run id or a RunSpec to create one (one of them)")
        self.policy = policy
        self.database_url = database_url
        self.run_id = run_id
        self.spec = spec
        self.control_tokens = list(
            control_tokens if control_tokens is not None else spec.control_tokens if spec else []
        )
        self.prepare = prepare
        self.price = price_per_device_hour
        self.heartbeat_seconds = heartbeat_seconds
        self.on_written = on_written
        self.busy_timeout_ms = busy_timeout_ms
        self.resume = resume
        self.written_steps = 0
        self.dropped_steps = 0
        self.dropped_rollouts = 0
        self._reported_drops = (0, 0)
        self._factory = factory
        self._engine: Engine | None = None  # ours to dispose (made from database_url)
        self._run_writer: store.RunWriter | None = None  # the store's, once the run exists
        self._inbox: deque[Any] = deque()  # handed over, not yet prepared (BufferAndDrop)
        self._buffer: deque[Pending] = deque()  # prepared, waiting for the database
        self._buffered_bytes = 0
        self._wake = threading.Condition()
        self._closing = False
        self._final: tuple[RunStatus, str | None] | None = None  # the run's end (for_script)
        self._deadline: float | None = None
        self._down_since: float | None = None
        self._attempts = 0
        self._uncertain = False  # a commit failed midway: it may have landed
        self._retry_at = 0.0
        self._retry_delay = RETRY_FIRST_SECONDS
        self._gave_up: str | None = None  # BufferAndDrop: a permanent error; recording stops
        self._error: BaseException | None = None  # WaitThenFail: raised on the training thread
        self._refusal_said = False
        self._ended: RunEnded | None = None  # the run ended elsewhere (a cancel): no more writes
        self._done = False
        self._lost_at_close = 0  # steps still waiting when close's timeout ran out (dropped)
        self._thread = threading.Thread(
            target=self._loop, name=f"rollout-lens-writer-{run_id or 'new'}", daemon=True
        )
        self._thread.start()

    @classmethod
    def for_script(
        cls,
        *,
        database_url: str,
        spec: RunSpec,
        prepare: Callable[[Any], StepRecord],
        max_bytes: int = 256 * 2**20,
        heartbeat_seconds: float = 5.0,
        price_per_device_hour: float = 0.0,
        busy_timeout_ms: int = 30_000,
        resume: tuple[str, int] | None = None,
    ) -> StepWriter:
        """A user's script: creates the run (or continues it: `resume`), buffers and drops
        rather than stop training."""
        return cls(
            resume=resume,
            policy=BufferAndDrop(max_bytes=max_bytes),
            database_url=database_url,
            spec=spec,
            prepare=prepare,
            price_per_device_hour=price_per_device_hour,
            heartbeat_seconds=heartbeat_seconds,
            busy_timeout_ms=busy_timeout_ms,
        )

    @classmethod
    def for_launched(
        cls,
        factory: sessionmaker[Session],
        *,
        run_id: int,
        control_tokens: list[str],
        price_per_device_hour: float,
        on_written: Callable[[StepRecord], None] | None = None,
        max_pending: int = 64,
        give_up_after: float = 60.0,
    ) -> StepWriter:
        """A launched run (the worker's): waits for the database, then fails the run."""
        return cls(
            policy=WaitThenFail(give_up_after=give_up_after, max_pending=max_pending),
            factory=factory,
            run_id=run_id,
            control_tokens=control_tokens,
            price_per_device_hour=price_per_device_hour,
            on_written=on_written,
        )

    @property
    def stop_requested(self) -> bool:
        """Whether the run was cancelled from the dashboard: training should stop (the callback
        stops it the way TRL stops, and ends the run `cancelled`)."""
        ended = self._ended
        return ended is not None and ended.status == RunStatus.cancelled

    @property
    def waits(self) -> bool:
        return isinstance(self.policy, WaitThenFail)

    @property
    def give_up_after(self) -> float:
        return self.policy.give_up_after if isinstance(self.policy, WaitThenFail) else 0.0

    # -- the training thread's side ----------------------------------------------------------------

    def put(self, raw: Any) -> None:
        """Hand a step over. BufferAndDrop: never blocks, never raises. WaitThenFail: prepared
        here, blocks while `max_pending` steps wait, raises the writer's error."""
        if not isinstance(self.policy, WaitThenFail):
            with self._wake:
                if self._ended is None:  # once the run has ended, nothing more is recorded
                    self._inbox.append(raw)
                    self._wake.notify_all()
            return
        self._raise_if_failed()
        record = self.prepare(raw)
        with self._wake:
            while len(self._buffer) >= self.policy.max_pending and self._error is None:
                self._wake.wait()
            self._raise_if_failed()
            self._buffer.append(Pending(record, 0))
            self._wake.notify_all()

    def flush(self) -> None:
        """Wait until every step handed over is written (a checkpoint must not outrun its
        records); WaitThenFail raises the writer's error."""
        with self._wake:
            while (self._buffer or self._inbox) and not self._stopped():
                self._wake.wait(timeout=0.5)
        self._raise_if_failed()

    def close(
        self,
        *,
        status: RunStatus = RunStatus.completed,
        error: str | None = None,
        timeout: float = 60.0,
    ) -> bool:
        """Write what is waiting and stop the thread; True when everything was written.

        BufferAndDrop waits at most `timeout` for the database, then marks the run finished
        with `status`; steps still waiting then are dropped and counted on the run
        (RemoteStepWriter: its end is sent once more, within FINAL_SECONDS, so that the run does
        not stay `running`). WaitThenFail writes everything (retrying within its policy) and
        raises the writer's error; the worker marks the run finished."""
        with self._wake:
            if not self._closing:
                self._closing = True
                self._final = (status, error)
                self._deadline = time.monotonic() + timeout
                self._retry_at = min(self._retry_at, time.monotonic())  # try once more now
                self._wake.notify_all()
        self._thread.join(None if self.waits else timeout + self.FINAL_SECONDS + 5.0)
        left = len(self._buffer) + len(self._inbox) + self._lost_at_close
        if left and not self.waits:
            log.warning(
                "Rollout Lens: %d recorded step(s) could not be written before the end of training "
                "(database unreachable); they are lost",
                left,
            )
        self._raise_if_failed()
        return left == 0

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error

    def _stopped(self) -> bool:
        stopped = self._error is not None or self._gave_up is not None
        return self._done or stopped or self._ended is not None

    # -- the writer thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._steps()
        except BaseException as exc:  # noqa: BLE001 - e.g. on_written raising: said, not lost
            self._fail(exc)
        finally:
            self._dispose()
            with self._wake:
                self._done = True
                self._wake.notify_all()

    def _steps(self) -> None:
        last_beat = 0.0
        while True:
            with self._wake:
                while not self._inbox and not self._due(last_beat):
                    self._wake.wait(timeout=self._wait_seconds(last_beat))
                inbound = list(self._inbox)
                self._inbox.clear()
                closing = self._closing
            for raw in inbound:
                self._take(raw)
            if self._stopped():
                break
            if time.monotonic() >= self._retry_at and self._flush():
                if closing and not self._inbox:
                    self._finish()
                    break
                if (
                    self.heartbeat_seconds is not None
                    and time.monotonic() - last_beat >= self.heartbeat_seconds
                ):
                    self._heartbeat()
                    last_beat = time.monotonic()
            if self._stopped():
                break
            if closing and not self.waits and time.monotonic() >= (self._deadline or 0.0):
                self._out_of_time()
                break

    def _out_of_time(self) -> None:
        """BufferAndDrop: close's timeout ran out with steps waiting: they are dropped and
        counted, and the run's end is tried once more (_finish_late)."""
        with self._wake:
            left = len(self._buffer) + len(self._inbox)
            self._buffer.clear()
            self._inbox.clear()
            self._buffered_bytes = 0
            self.dropped_steps += left
            self._lost_at_close = left
            self._wake.notify_all()
        self._finish_late()

    def _finish_late(self) -> None:
        """The run's end after close's timeout: nothing here (the database did not answer in
        time; a run whose heartbeats stop is marked lost by the dashboard's sweeper)."""

    def _due(self, last_beat: float) -> bool:
        now = time.monotonic()
        if self._closing and now >= self._retry_at:
            return True
        if self._closing and not self.waits and now >= (self._deadline or 0.0):
            return True
        if self._buffer and now >= self._retry_at:
            return True
        beats = self.heartbeat_seconds is not None and self.run_id is not None
        return beats and now - last_beat >= (self.heartbeat_seconds or 0.0)

    def _wait_seconds(self, last_beat: float) -> float:
        now = time.monotonic()
        waits = [5.0]
        if self.heartbeat_seconds is not None:
            waits.append(self.heartbeat_seconds - (now - last_beat))
        if self._buffer or self._closing:
            waits.append(self._retry_at - now)
        if self._closing and self._deadline is not None and not self.waits:
            waits.append(self._deadline - now)
        return max(0.05, min(waits))

    def _take(self, raw: Any) -> None:
        """BufferAndDrop: prepare a step (a bad one is dropped alone) and keep it in budget."""
        try:
            record = self.prepare(raw)
        except Exception as exc:  # noqa: BLE001 - a bad step must not stop the others
            self.dropped_steps += 1
            log.warning("Rollout Lens: could not prepare step for recording (dropped): %s", exc)
            return
        pending = Pending(record, record_size(record))
        with self._wake:
            self._buffer.append(pending)
            self._buffered_bytes += pending.size
            self._enforce_budget()

    def _enforce_budget(self) -> None:
        """Past the budget, drop the oldest steps' rollouts first, then the oldest steps."""
        assert isinstance(self.policy, BufferAndDrop)
        if self._buffered_bytes <= self.policy.max_bytes:
            return
        for pending in self._buffer:
            if self._buffered_bytes <= self.policy.max_bytes:
                return
            if pending.record.rollouts:
                self.dropped_rollouts += len(pending.record.rollouts)
                pending.record.rollouts = []
                smaller = record_size(pending.record)
                self._buffered_bytes -= pending.size - smaller
                pending.size = smaller
        while self._buffer and self._buffered_bytes > self.policy.max_bytes:
            pending = self._buffer.popleft()
            self._buffered_bytes -= pending.size
            self.dropped_steps += 1

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

    def _flush(self) -> bool:
        """Create the run if needed and write the waiting steps in order; False if the database
        is away (the steps stay) or the policy gave up."""
        try:
            factory = self._connect()
            if self.run_id is None:
                self._create_run(factory)
            while self._buffer:
                self._write_batch(factory)
            self._report_drops(factory)
        except RunEnded as exc:
            self._run_ended(exc)
            return False
        except DBAPIError as exc:
            if not is_transient(exc):
                self._fail(exc)
                return False
            self._went_down(exc)
            return False
        except OSError as exc:  # e.g. a SQLite file on a disk that went away
            self._went_down(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. a database at a newer schema
            self._fail(exc)
            return False
        self._came_back()
        return True

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

    def _write_batch(self, factory: sessionmaker[Session]) -> None:
        """Write the oldest waiting steps (up to BATCH_STEPS) in one transaction; they leave the
        buffer once committed. A refused batch is written one step at a time to find the step
        the database refuses or already has (a commit whose answer was lost)."""
        with self._wake:
            batch = list(itertools.islice(self._buffer, BATCH_STEPS))
        try:
            self._commit(factory, [p.record for p in batch])
        except StepRefused as refused:  # out of order, or rollouts the run has (RolloutsTaken)
            culprit = refused
            if len(batch) > 1:
                batch = batch[:1]  # find the step at fault: the next call goes on with the others
                try:
                    self._commit(factory, [batch[0].record])
                except StepRefused as single:
                    culprit = single
                else:
                    self._written(batch)
                    return
            self._out_of_order(batch[0], culprit)
            return
        except DBAPIError as exc:
            if is_transient(exc) or len(batch) == 1:
                self._settle(batch[0], exc)
                return
            batch = batch[:1]  # find the culprit: the next call goes on with the others
            try:
                self._commit(factory, [batch[0].record])
            except DBAPIError as single:
                self._settle(batch[0], single)
                return
        self._written(batch)

    def _run_ended(self, exc: RunEnded) -> None:
        """The run ended elsewhere: recording stops (what waits is dropped, not counted as lost:
        the run has its end); a cancel asks the callback to stop training (stop_requested)."""
        with self._wake:
            self._ended = exc
            self._buffer.clear()
            self._inbox.clear()
            self._buffered_bytes = 0
            self._wake.notify_all()
        if exc.status == RunStatus.cancelled:
            who = dashboard_caller(exc.ended_by)
            log.warning(
                "Rollout Lens: the dashboard cancelled run %s%s: training stops",
                exc.run_id,
                f" (by {who})" if who else "",
            )
        else:
            log.warning(
                "Rollout Lens: run %s ended as %s%s: recording stops, training goes on",
                exc.run_id,
                exc.status,
                f" (by {exc.ended_by})" if exc.ended_by else "",
            )

    def _leave(self, batch: list[Pending]) -> None:
        """The oldest waiting steps leave the buffer (written, already there, or dropped)."""
        with self._wake:
            for pending in batch:
                self._buffer.popleft()
                self._buffered_bytes -= pending.size
            self._wake.notify_all()

    def _written(self, batch: list[Pending], *, counted: bool = True) -> None:
        """Steps that are in the database (`counted`: written by this commit)."""
        self._leave(batch)
        if counted:
            self.written_steps += len(batch)
        self._uncertain = False
        if self.on_written is not None:
            for pending in batch:
                self.on_written(pending.record)

    def _settle(self, pending: Pending, exc: DBAPIError) -> None:
        """A step the database would not take: retry later, skip it, drop it or fail."""
        if is_transient(exc):
            self._uncertain = True
            raise exc
        if isinstance(exc, IntegrityError) and (self._uncertain or not self.waits):
            # The step is there already: a commit whose answer the connection lost. Not twice.
            log.info("Rollout Lens: step %d was already written", pending.record.step)
            self._written([pending], counted=False)
            return
        if self.waits:
            raise exc  # a launched run fails at the step the database refuses
        self._refused(pending.record, exc)  # this step only; the others go on
        self._leave([pending])

    def _commit(self, factory: sessionmaker[Session], records: list[StepRecord]) -> None:
        assert self.run_id is not None
        if self._run_writer is None:
            self._run_writer = store.RunWriter(
                self.run_id, control_tokens=self.control_tokens, price_per_hour=self.price
            )
        # A script's run: its row is held first, RunEnded once it was cancelled from the
        # dashboard (a launched run's worker asks about a cancel: trainer/worker/monitor.py).
        guard = None if self.waits else functools.partial(ending.recorder_alive, run_id=self.run_id)
        self._run_writer.commit(factory.kw["bind"], records, guard=guard)

    def _out_of_order(self, pending: Pending, exc: StepRefused) -> None:
        """A step that comes after a later one, or whose rollouts the run has: a launched run
        fails (its steps never go back); a script's is dropped alone, as a step the database
        refuses."""
        if self.waits:
            raise exc
        self._refused(pending.record, exc)
        self._leave([pending])

    def _refused(self, record: StepRecord, exc: BaseException) -> None:
        self.dropped_steps += 1
        if not self._refusal_said:
            self._refusal_said = True
            log.warning(
                "Rollout Lens: the database refused step %d (dropped; later refusals are only "
                "counted on the run): %s",
                record.step,
                short(exc),
            )

    def _report_drops(self, factory: sessionmaker[Session]) -> None:
        drops = (self.dropped_steps, self.dropped_rollouts)
        if drops == self._reported_drops or self.run_id is None:
            return
        with session_scope(factory) as session:
            store.set_dropped(session, run_id=self.run_id, steps=drops[0], rollouts=drops[1])
        self._reported_drops = drops

    def _heartbeat(self) -> None:
        if self.run_id is None or self._factory is None:
            return
        try:
            with session_scope(self._factory) as session:
                if self.waits:
                    store.heartbeat(session, run_id=self.run_id)
                else:  # a cancel is heard between slow steps too
                    ending.recorder_alive(session, run_id=self.run_id)
        except RunEnded as exc:
            self._run_ended(exc)
        except Exception as exc:  # noqa: BLE001 - the next write will find out and buffer
            self._went_down(exc)

    def _finish(self) -> None:
        """BufferAndDrop: the run is ours to mark finished (the worker marks launched runs)."""
        if self.waits or self._final is None or self._factory is None or self.run_id is None:
            return
        status, error = self._final
        try:
            with session_scope(self._factory) as session:
                ending.finish_recorded(session, run_id=self.run_id, status=status, error=error)
        except RunEnded as exc:  # cancelled from the dashboard since the last write: it stays
            log.warning("Rollout Lens: %s", exc)
        except Exception as exc:  # noqa: BLE001 - nothing left to do but say so
            log.warning("Rollout Lens: could not mark run %s finished: %s", self.run_id, exc)

    def _dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def _what(self) -> str:
        """The steps being written, as an error message names them."""
        if not self._buffer:
            return f"recording run {self.run_id}"
        first = self._buffer[0].record.step
        last = self._buffer[min(len(self._buffer), BATCH_STEPS) - 1].record.step
        steps = f"{first}" + (f"–{last}" if last != first else "")
        return f"recording step {steps} of run {self.run_id}"

    def _went_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._attempts += 1
        if self._down_since is None:
            self._down_since = now
            self._retry_delay = RETRY_FIRST_SECONDS
            if self.waits:
                log.warning(
                    "Rollout Lens: the database failed while %s (%s); retrying for up to %.0f s",
                    self._what(),
                    short(exc),
                    self.give_up_after,
                )
            else:
                assert isinstance(self.policy, BufferAndDrop)
                log.warning(
                    "Rollout Lens: %s is unreachable (%s); training goes on and steps "
                    "are kept in memory (up to %.1f MB) until it is back",
                    self.AWAY,
                    short(exc),
                    self.policy.max_bytes / 2**20,
                )
        else:
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_SECONDS)
        waited = now - self._down_since
        if self.waits and waited >= self.give_up_after:
            away = gave_up(self._what(), waited, self._attempts, exc)
            self._fail(away)
            return
        delay = self._retry_delay
        if self.waits:
            delay = min(delay, self.give_up_after - waited)
        self._retry_at = now + delay

    def _came_back(self) -> None:
        if self._down_since is not None:
            if self.waits:
                log.warning(
                    "Rollout Lens: the database is back after %.0f s; recording goes on",
                    time.monotonic() - self._down_since,
                )
            else:
                log.warning(
                    "Rollout Lens: %s is back after %.0f s; buffered steps written "
                    "(dropped so far: %d steps, %d rollouts)",
                    self.AWAY,
                    time.monotonic() - self._down_since,
                    self.dropped_steps,
                    self.dropped_rollouts,
                )
            self._down_since = None
            self._attempts = 0
            self._retry_delay = RETRY_FIRST_SECONDS

    def _fail(self, exc: BaseException) -> None:
        """A permanent error: a launched run fails; a script's recording stops, training goes on."""
        if self.waits:
            if not isinstance(exc, DatabaseAway):
                wrapped = RuntimeError(f"{self._what()} failed: {short(exc)}")
                wrapped.__cause__ = exc
                exc = wrapped
            with self._wake:
                self._error = exc
                self._wake.notify_all()
            return
        self._gave_up = short(exc)
        with self._wake:
            self.dropped_steps += len(self._buffer) + len(self._inbox)
            self._buffer.clear()
            self._inbox.clear()
            self._buffered_bytes = 0
            self._wake.notify_all()
        log.error("Rollout Lens: recording stopped, training goes on: %s", self._gave_up)


# -- waiting out a database that is away, outside the step stream ---------------------------------


def is_transient(exc: DBAPIError) -> bool:
    """Connection trouble (retry) rather than a statement the database refuses (give up)."""
    return bool(exc.connection_invalidated) or isinstance(exc, OperationalError)


def gave_up(what: str, waited: float, attempts: int, exc: BaseException) -> DatabaseAway:
    """The error (logged once) of a database that stayed away longer than the caller waits."""
    log.error("Rollout Lens: %s failed after %.0f s: %s", what, waited, short(exc))
    away = DatabaseAway(
        f"{what} failed: the database could not be written for {waited:.0f} s "
        f"({attempts} attempts): {short(exc)}"
    )
    away.__cause__ = exc
    return away


def with_retries(
    action: Callable[[bool], T],
    *,
    what: str,
    give_up_after: float,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`action(retried)` until it succeeds; transient database errors are retried with the
    writer's backoff for at most `give_up_after` seconds, then DatabaseAway is raised. `retried`
    tells the action that an earlier attempt may have committed without its answer arriving."""
    delay, down_since, attempts = RETRY_FIRST_SECONDS, None, 0
    while True:
        try:
            result = action(attempts > 0)
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            attempts += 1
            now = time.monotonic()
            if down_since is None:
                down_since = now
                log.warning(
                    "Rollout Lens: the database failed while %s (%s); retrying for up to %.0f s",
                    what,
                    short(exc),
                    give_up_after,
                )
            waited = now - down_since
            if waited >= give_up_after:
                raise gave_up(what, waited, attempts, exc) from exc
            sleep(min(delay, give_up_after - waited))
            delay = min(delay * 2, RETRY_MAX_SECONDS)
            continue
        if down_since is not None:
            log.warning(
                "Rollout Lens: the database is back after %.0f s; %s done",
                time.monotonic() - down_since,
                what,
            )
        return result


def mark_finished(
    factory: sessionmaker[Session], run_id: int, give_up_after: float, **columns: Any
) -> None:
    """store.mark_finished(status=..., error=...), waiting out a database that is away; if it
    stays away (DatabaseAway) the heartbeats have stopped too and the dashboard marks the run
    lost."""

    def finish(_retried: bool) -> None:
        with session_scope(factory) as session:
            store.mark_finished(session, run_id=run_id, **columns)

    with_retries(
        finish,
        what=f"marking run {run_id} {columns['status']}",
        give_up_after=max(give_up_after, FINISH_GIVE_UP_SECONDS),
    )


def short(exc: BaseException) -> str:
    """The first line of the driver's message (not SQLAlchemy's statement dump)."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
