"""A writer that never breaks training: steps wait in a bounded buffer while the database is away.

The TRL callback hands raw steps over with `put`, which never blocks and never raises. A daemon
thread turns them into StepRecords (summaries, user functions: work kept off the training
thread), creates the run when the database first answers and writes the steps waiting, up to
BATCH_STEPS per transaction (one when training is slower than writing). While the database is unreachable the steps stay in memory, up to a byte budget;
past it the oldest steps lose their rollouts first (their per-step values are kept), then whole
steps go. What was dropped is counted on the run. Problems are logged once, not once per step.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.models import RunSource, RunStatus
from rollout_lens.server.records import StepRecord
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("rollout_lens")

BATCH_STEPS = 32  # buffered steps written per transaction (a backlog drains in few commits)
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 15.0


@dataclass
class RunSpec:
    """What the run row says about a recorded run."""

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


@dataclass
class _Pending:
    record: StepRecord
    size: int  # approximate bytes held


# What a Python list holds per item: an 8-byte pointer plus the object — a float is 24 bytes, a
# token id (an int past 256) 28, a token's text ~50 plus its characters. At 512 rollouts ×
# 1,024 tokens × 4 control tokens a step is ~140 MB as the trainer hands it over (tracemalloc),
# not the 8 bytes a value it would take packed.
_FLOAT, _ID, _TEXT = 8 + 24, 8 + 28, 8 + 49


def record_size(record: StepRecord) -> int:
    """Approximate bytes a step holds in memory (dominated by rollouts and their arrays, as the
    Python lists they are)."""
    size = 200 + 40 * (len(record.values) + len(record.metrics))
    for r in record.rollouts:
        n = len(r.completion_ids)
        size += 300 + len(r.completion) + len(r.prompt) // 8  # prompts are shared between rollouts
        size += n * (_ID + _FLOAT * (1 + len(r.control_probs)))
        if r.tokens:
            size += n * _TEXT + sum(map(len, r.tokens))
    return size


class Outbox:
    """Steps to the database on a daemon thread, buffered within `max_bytes` while it is away."""

    def __init__(
        self,
        *,
        database_url: str,
        spec: RunSpec,
        prepare: Callable[[Any], StepRecord],
        max_bytes: int = 256 * 2**20,
        heartbeat_seconds: float = 5.0,
        price_per_device_hour: float = 0.0,
        busy_timeout_ms: int = 30_000,
    ) -> None:
        self.database_url = database_url
        self.spec = spec
        self.prepare = prepare  # raw step (from the training thread) -> StepRecord
        self.max_bytes = max_bytes
        self.heartbeat_seconds = heartbeat_seconds
        self.price = price_per_device_hour
        self.busy_timeout_ms = busy_timeout_ms
        self.run_id: int | None = None
        self.written_steps = 0
        self.dropped_steps = 0
        self.dropped_rollouts = 0
        self._reported_drops = (0, 0)
        self._inbox: deque[Any] = deque()
        self._buffer: deque[_Pending] = deque()
        self._buffered_bytes = 0
        self._wake = threading.Condition()
        self._closing = False
        self._final_status: RunStatus = RunStatus.completed
        self._final_error: str | None = None
        self._deadline: float | None = None
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._retry_delay = RETRY_FIRST_SECONDS
        self._gave_up: str | None = None  # a permanent error: recording stops, training goes on
        self._refusal_said = False
        self._engine: Engine | None = None
        self._factory: sessionmaker[Session] | None = None
        self._recorder: store.Recorder | None = None
        self._thread = threading.Thread(target=self._loop, name="rollout-lens-outbox", daemon=True)
        self._thread.start()

    # -- the training thread's side ----------------------------------------------------------------

    def put(self, raw: Any) -> None:
        """Hand a step over; never blocks, never raises."""
        with self._wake:
            self._inbox.append(raw)
            self._wake.notify()

    def close(
        self,
        *,
        status: RunStatus = RunStatus.completed,
        error: str | None = None,
        timeout: float = 60.0,
    ) -> bool:
        """Write what is buffered (waiting at most `timeout` for the database), mark the run
        finished; True when everything was written."""
        with self._wake:
            if self._closing:
                return not self._buffer and not self._inbox
            self._closing = True
            self._final_status, self._final_error = status, error
            self._deadline = time.monotonic() + timeout
            self._retry_at = 0.0  # try once more now
            self._wake.notify()
        self._thread.join(timeout + 5.0)
        left = len(self._buffer) + len(self._inbox)
        if left:
            log.warning(
                "Rollout Lens: %d recorded step(s) could not be written before the end of training "
                "(database unreachable); they are lost",
                left,
            )
        return left == 0

    # -- the writer thread -------------------------------------------------------------------------

    def _loop(self) -> None:
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
            ready = self._gave_up is None and time.monotonic() >= self._retry_at
            if ready and self._flush():
                if closing:
                    self._finish()
                    return
                if time.monotonic() - last_beat >= self.heartbeat_seconds:
                    self._heartbeat()
                    last_beat = time.monotonic()
            if closing and (
                self._gave_up is not None or time.monotonic() >= (self._deadline or 0.0)
            ):
                self._dispose()
                return

    def _due(self, last_beat: float) -> bool:
        now = time.monotonic()
        if self._closing and now >= min(self._retry_at, self._deadline or 0.0):
            return True
        if self._buffer and now >= self._retry_at:
            return True
        return self.run_id is not None and now - last_beat >= self.heartbeat_seconds

    def _wait_seconds(self, last_beat: float) -> float:
        now = time.monotonic()
        waits = [self.heartbeat_seconds - (now - last_beat)]
        if self._buffer or self._closing:
            waits.append(self._retry_at - now)
        if self._closing and self._deadline is not None:
            waits.append(self._deadline - now)
        return max(0.05, min(waits))

    def _take(self, raw: Any) -> None:
        try:
            record = self.prepare(raw)
        except Exception as exc:  # noqa: BLE001 - a bad step must not stop the others
            self.dropped_steps += 1
            log.warning("Rollout Lens: could not prepare step for recording (dropped): %s", exc)
            return
        pending = _Pending(record, record_size(record))
        self._buffer.append(pending)
        self._buffered_bytes += pending.size
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        """Past the budget, drop the oldest steps' rollouts first, then the oldest steps."""
        if self._buffered_bytes <= self.max_bytes:
            return
        for pending in self._buffer:
            if self._buffered_bytes <= self.max_bytes:
                return
            if pending.record.rollouts:
                self.dropped_rollouts += len(pending.record.rollouts)
                pending.record.rollouts = []
                smaller = record_size(pending.record)
                self._buffered_bytes -= pending.size - smaller
                pending.size = smaller
        while self._buffer and self._buffered_bytes > self.max_bytes:
            pending = self._buffer.popleft()
            self._buffered_bytes -= pending.size
            self.dropped_steps += 1

    def _connect(self) -> sessionmaker[Session]:
        if self._factory is None:
            from rollout_lens.server.migrate import upgrade

            engine = make_engine(self.database_url, busy_timeout_ms=self.busy_timeout_ms)
            try:
                upgrade(engine)
            except Exception:
                engine.dispose()
                raise
            self._engine, self._factory = engine, make_session_factory(engine)
        return self._factory

    def _flush(self) -> bool:
        """Create the run if needed and write the buffered steps in order; False if the database
        is away (the steps stay buffered)."""
        try:
            factory = self._connect()
            if self.run_id is None:
                self._create_run(factory)
            while self._buffer:
                self._write_batch(factory)
            self._report_drops(factory)
        except (OperationalError, DBAPIError, OSError) as exc:
            if isinstance(exc, DBAPIError) and not _is_transient(exc):
                self._give_up(exc)  # creating the run or migrating was refused
                return False
            self._went_down(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. a database at a newer schema
            self._give_up(exc)
            return False
        self._came_back()
        return True

    def _create_run(self, factory: sessionmaker[Session]) -> None:
        spec = self.spec
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

    def _write_batch(self, factory: sessionmaker[Session]) -> None:
        """Write the oldest buffered steps (up to BATCH_STEPS) in one transaction; they leave the
        buffer once committed. If the batch is refused, write them one at a time to find the
        step the database refuses (dropped) or already has (a commit whose answer was lost)."""
        batch = list(itertools.islice(self._buffer, BATCH_STEPS))
        try:
            self._commit(factory, [p.record for p in batch])
        except DBAPIError as exc:
            if _is_transient(exc) or len(batch) == 1:
                self._settle(batch[0], exc)
                return
            batch = batch[:1]  # find the culprit: the next call goes on with the others
            try:
                self._commit(factory, [batch[0].record])
            except DBAPIError as single:
                self._settle(batch[0], single)
                return
        for pending in batch:
            self._buffer.popleft()
            self._buffered_bytes -= pending.size
            self.written_steps += 1

    def _settle(self, pending: _Pending, exc: DBAPIError) -> None:
        """A step the database would not take: retry later, skip it, or drop it."""
        if _is_transient(exc):
            raise exc
        if isinstance(exc, IntegrityError):
            # The step is there already: a commit whose answer the connection lost. Not twice.
            log.info("Rollout Lens: step %d was already written", pending.record.step)
        else:
            self._refused(pending.record, exc)  # this step only; the others go on
        self._buffer.popleft()
        self._buffered_bytes -= pending.size

    def _commit(self, factory: sessionmaker[Session], records: list[StepRecord]) -> None:
        assert self.run_id is not None
        recorder, self._recorder = self._recorder, None  # kept only if the batch commits
        self._recorder = store.write_batch(
            factory.kw["bind"],
            recorder,
            records,
            run_id=self.run_id,
            control_tokens=self.spec.control_tokens,
            price_per_hour=self.price,
        )

    def _refused(self, record: StepRecord, exc: DBAPIError) -> None:
        self.dropped_steps += 1
        if not self._refusal_said:
            self._refusal_said = True
            log.warning(
                "Rollout Lens: the database refused step %d (dropped; later refusals are only "
                "counted on the run): %s",
                record.step,
                _short(exc),
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
                store.heartbeat(session, run_id=self.run_id)
        except Exception as exc:  # noqa: BLE001 - the next write will find out and buffer
            self._went_down(exc)

    def _finish(self) -> None:
        assert self._factory is not None and self.run_id is not None
        try:
            with session_scope(self._factory) as session:
                store.mark_finished(
                    session,
                    run_id=self.run_id,
                    status=self._final_status,
                    error=self._final_error,
                )
        except Exception as exc:  # noqa: BLE001 - nothing left to do but say so
            log.warning("Rollout Lens: could not mark run %s finished: %s", self.run_id, exc)
        self._dispose()

    def _dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()

    def _went_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._retry_delay = RETRY_FIRST_SECONDS
            log.warning(
                "Rollout Lens: the database is unreachable (%s); training goes on and steps are "
                "kept in memory (up to %.1f MB) until it is back",
                _short(exc),
                self.max_bytes / 2**20,
            )
        else:
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_SECONDS)
        self._retry_at = now + self._retry_delay

    def _came_back(self) -> None:
        if self._down_since is not None:
            log.warning(
                "Rollout Lens: the database is back after %.0f s; buffered steps written "
                "(dropped so far: %d steps, %d rollouts)",
                time.monotonic() - self._down_since,
                self.dropped_steps,
                self.dropped_rollouts,
            )
            self._down_since = None
            self._retry_delay = RETRY_FIRST_SECONDS

    def _give_up(self, exc: BaseException) -> None:
        self._gave_up = _short(exc)
        self.dropped_steps += len(self._buffer)
        self._buffer.clear()
        self._buffered_bytes = 0
        log.error("Rollout Lens: recording stopped, training goes on: %s", self._gave_up)


def _is_transient(exc: DBAPIError) -> bool:
    """Connection trouble (retry) rather than a statement the database refuses (give up)."""
    return bool(exc.connection_invalidated) or isinstance(exc, OperationalError)


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
