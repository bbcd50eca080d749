"""Liveness and control of a training process: heartbeats, cancel requests, checkpoints."""

from __future__ import annotations

import threading
import time

from rollout_lens.server import store
from rollout_lens.server.store.db import session_scope
from rollout_lens.trainer.recorder.writer import StepWriter, with_retries
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from transformers import TrainerCallback

CANCEL_POLL_SECONDS = 0.5  # a cancel lands within a step or two without a query every step


class RunMonitor:
    """Beats the run's heartbeat from a daemon thread; answers "was this run cancelled?"."""

    def __init__(self, factory: sessionmaker[Session], *, run_id: int, interval: float) -> None:
        self.factory = factory
        self.run_id = run_id
        self.interval = interval
        self._stop = threading.Event()
        self._cancelled = False
        self._checked_at = 0.0
        self._thread = threading.Thread(
            target=self._beat, name=f"rollout-lens-heartbeat-{run_id}", daemon=True
        )

    def __enter__(self) -> RunMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def should_stop(self) -> bool:
        """True once someone asked the run to stop (checked at most every half second)."""
        now = time.monotonic()
        if not self._cancelled and now - self._checked_at >= CANCEL_POLL_SECONDS:
            self._checked_at = now
            try:
                with session_scope(self.factory) as session:
                    self._cancelled = store.cancel_requested(session, run_id=self.run_id)
            except DBAPIError:
                pass  # the database is away: asked again next time; the writer waits for it
        return self._cancelled

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with session_scope(self.factory) as session:
                    store.heartbeat(session, run_id=self.run_id)
            except Exception:  # noqa: BLE001 - a missed beat is retried; the run goes on
                continue


class CheckpointRecorder(TrainerCallback):
    """After each checkpoint: flush the recorded steps, then note the checkpoint on the run.

    The order matters: a resume restarts after `checkpoint_step`, so every step up to it must
    already be in the database.
    """

    def __init__(self, factory: sessionmaker[Session], writer: StepWriter, *, run_id: int) -> None:
        self.factory = factory
        self.writer = writer
        self.run_id = run_id

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.writer.flush()

        def note(_retried: bool) -> None:
            with session_scope(self.factory) as session:
                store.set_checkpoint(session, run_id=self.run_id, step=state.global_step)

        with_retries(
            note,
            what=f"noting checkpoint {state.global_step} of run {self.run_id}",
            give_up_after=self.writer.give_up_after,
        )
