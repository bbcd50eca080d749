"""A background writer: steps go to the database off the training thread, one transaction each."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from rollout_lens.server import store
from rollout_lens.server.db import session_scope
from rollout_lens.server.records import StepRecord
from rollout_lens.trainer.retry import with_retries
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

_STOP = object()


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
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is None:  # after an error, drain without writing
                    self._write(item)
            finally:
                self._queue.task_done()

    def _write(self, item: object) -> None:
        assert isinstance(item, StepRecord)
        try:
            with_retries(
                lambda retried: self._commit(item, retried),
                what=f"recording step {item.step} of run {self.run_id}",
                give_up_after=self.give_up_after,
            )
            if self.on_written is not None:
                self.on_written(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _commit(self, item: StepRecord, retried: bool) -> None:
        try:
            with session_scope(self.factory) as session:
                store.record_step(
                    session, run_id=self.run_id, record=item, control_tokens=self.control_tokens
                )
                store.add_device_time(
                    session,
                    run_id=self.run_id,
                    seconds=item.values.get("wall_time") or 0.0,
                    price_per_hour=self.price,
                )
        except IntegrityError:
            if not retried:
                raise
            # An earlier attempt committed but its answer was lost with the connection: the
            # step is there, once (its primary key says so).
