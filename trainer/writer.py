"""A background writer: steps go to the database off the training thread; the steps waiting when
it wakes share one transaction (one step each when training is slower than writing)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from rollout_lens.server import store
from rollout_lens.server.records import StepRecord
from rollout_lens.trainer.retry import with_retries
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

_STOP = object()
BATCH_STEPS = 32


class StepWriter:
    """Queue StepRecords from the trainer; a daemon thread writes them in order.

    A write error is re-raised on the training thread at the next `put` or at `close`, so a run
    never trains on while its records are being lost. A database that goes away is waited for
    (trainer.retry) up to `give_up_after` seconds; meanwhile the queue fills and training waits.
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        run_id: int,
        control_tokens: Sequence[str],
        price_per_device_hour: float,
        on_written: Callable[[StepRecord], None] | None = None,
        max_pending: int = 64,
        give_up_after: float = 60.0,
    ) -> None:
        self.factory = factory
        self.engine: Engine = factory.kw["bind"]
        self._recorder: store.Recorder | None = None
        self.run_id = run_id
        self.control_tokens = list(control_tokens)
        self.price = price_per_device_hour
        self.on_written = on_written
        self.give_up_after = give_up_after
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"rollout-lens-writer-{run_id}", daemon=True
        )
        self._thread.start()

    def put(self, record: StepRecord) -> None:
        """Hand a step to the writer (blocks only if the writer is far behind)."""
        self._raise_if_failed()
        self._queue.put(record)

    def flush(self) -> None:
        """Wait until every queued step is written (a checkpoint must not outrun its records)."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        """Write everything queued, stop the thread, re-raise a write error."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"recording step failed: {self._error}") from self._error

    def _loop(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < BATCH_STEPS:  # whatever else is waiting goes in the same commit
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                records = [item for item in items if isinstance(item, StepRecord)]
                if records and self._error is None:  # after an error, drain without writing
                    self._write(records)
            finally:
                for _ in items:
                    self._queue.task_done()
            if any(item is _STOP for item in items):
                return

    def _write(self, records: list[StepRecord]) -> None:
        try:
            steps = f"{records[0].step}" + (f"–{records[-1].step}" if len(records) > 1 else "")
            with_retries(
                lambda retried: self._commit(records, retried),
                what=f"recording step {steps} of run {self.run_id}",
                give_up_after=self.give_up_after,
            )
            if self.on_written is not None:
                for record in records:
                    self.on_written(record)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _commit(self, records: list[StepRecord], retried: bool) -> None:
        recorder, self._recorder = self._recorder, None  # kept only if the batch commits
        try:
            self._recorder = store.write_batch(
                self.engine,
                recorder,
                records,
                run_id=self.run_id,
                control_tokens=self.control_tokens,
                price_per_hour=self.price,
            )
        except IntegrityError:
            if retried:
                # An earlier attempt committed but its answer was lost with the connection: the
                # steps are there, once (the batch was one transaction; keys say so).
                return
            raise
