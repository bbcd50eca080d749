"""Follow a dump folder while its trainer writes it (`import-verl --follow`, `import-trl --follow`).

The run is `running` while followed, with a heartbeat every `heartbeat_seconds`, so the dashboard
shows it live. Each poll records the steps whose files are whole (server/exchange/dump_files.py says when)
in one transaction. The files already there when the follower starts are read first, all in one
transaction: a bad one creates nothing. Following ends:

- `idle` seconds after the last new or changed dump file: the steps still waiting are recorded,
  and the run is `completed`;
- when `stop()` says so (Ctrl-C in the CLI): the run is `cancelled` at once (steps not yet
  recorded wait for the next follower);
- on Cancel in the dashboard: `cancelled`;
- on a file that is not the format's: the run is `failed` with the message, and it is raised.

A follower started again on the same folder resumes the newest run of that folder and source
after its last recorded step (read from the database), so no step is recorded twice; a run whose
follower still beats its heartbeat is refused, and so is one whose first step's file was written
again since it was recorded (the trainer started over there: `new` starts a new run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange.dump_files import (
    SETTLE_SECONDS,
    Incomplete,
    Settling,
    Unit,
    units,
)
from rollout_lens.server.exchange.dump_import import (
    DumpFormat,
    DumpWriter,
    RunPlan,
    create_run,
    readable,
    refused,
)
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import EndedBy, RunRow, RunStatus, utcnow
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

POLL_SECONDS = 1.0  # how often the folder is listed
# Steps per transaction once the run exists: a long catch-up commits (and so shows its heartbeat)
# now and then, and the sweeper does not take the run for lost.
STEPS_PER_WRITE = 20
SLICE_SECONDS = 0.1  # how often a wait looks at stop()
# A first step's file modified this long after it was recorded means the trainer started over
# (the margin absorbs a file system's clock being off from this machine's).
REWRITTEN_AFTER = 60.0


@dataclass
class _Followed:
    """How following ended: the run (None if no step ever came), what this follower recorded,
    and why it stopped: idle (completed), interrupted or cancelled (both cancelled)."""

    run_id: int | None
    name: str | None
    steps: int
    rollouts: int
    ended: str


class Follower:
    """Records a dump folder's steps as they are written (see the module docstring)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        fmt: DumpFormat,
        *,
        host: str,
        idle: float | None = None,
        settle: float = SETTLE_SECONDS,
        total_steps: int | None = None,
        new: bool = False,
        heartbeat_seconds: float = 5.0,
        lost_after_seconds: float = 60.0,
        poll: float = POLL_SECONDS,
        stop: Callable[[], bool] = lambda: False,
        say: Callable[[str], None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factory = factory
        self.fmt = fmt
        self.host = host
        self.idle = idle
        self.total_steps = total_steps
        self.new = new  # a new run even where one follows this folder
        self.heartbeat_seconds = heartbeat_seconds
        self.lost_after_seconds = lost_after_seconds
        self.poll = poll
        self.stop = stop
        self.say = say
        self.clock = clock
        self.settling = Settling(settle, clock)
        self.run_id: int | None = None
        self.name: str | None = None
        self.writer: DumpWriter | None = None
        self.after: int | None = None
        self.steps = 0
        self.rollouts = 0
        self.active_at = clock()
        self.beat_at = clock()
        self.resumed = False  # the run was there before this follower

    def run(self) -> _Followed:
        """Follow until idle, stopped or cancelled (module docstring); InvalidInput on bad input."""
        self.fmt.scan()  # a missing folder is refused before anything is looked up
        self._resume()
        if self.run_id is None and not self.fmt.scan():
            self.say(f"waiting for dump files in {self.fmt.folder}")
        try:
            ended = self._loop()
        except InvalidInput as exc:
            self._finish(RunStatus.failed, str(exc))
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: the write in progress was rolled back
            self._finish(RunStatus.cancelled, None)
            raise
        return _Followed(self.run_id, self.name, self.steps, self.rollouts, ended)

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> str:
        while True:
            if self.stop():
                self._finish(RunStatus.cancelled, None)
                return "interrupted"
            busy = self._record(final=False)
            now = self.clock()
            self.active_at = max(self.active_at, self.settling.last_change)
            if self.run_id is not None and now - self.beat_at >= self.heartbeat_seconds:
                self.beat_at = now
                if self._beat():
                    self._finish(RunStatus.cancelled, None)
                    return "cancelled"
            if self.idle is not None and now - self.active_at >= self.idle:
                while self._record(final=True):
                    pass
                if self.run_id is None:
                    raise InvalidInput(f"{self.fmt.empty} (waited {self.idle:g} s)")
                self._finish(RunStatus.completed, None)
                return "idle"
            if not busy:  # more steps may be waiting: look again at once
                self._wait(self.poll)

    def _wait(self, seconds: float) -> None:
        end = self.clock() + seconds
        while not self.stop() and (left := end - self.clock()) > 0:
            time.sleep(min(SLICE_SECONDS, left))

    def _record(self, *, final: bool) -> bool:
        """Record the steps ready now (at most STEPS_PER_WRITE); at the end (`final`) the newest
        also without the file it waits for. A newest file that does not read whole is left for
        later (or, at the end, reported and left out). Whether any step was recorded."""
        fmt = self.fmt
        found = units(
            fmt.scan(),
            after=self.after,
            settling=self.settling,
            wants_more=fmt.wants_more,
            final=final,
        )
        if self.writer is not None:
            found = found[:STEPS_PER_WRITE]
        checked = readable(fmt, found, final=False)
        if final and len(checked) < len(found):
            self.say(f"{found[len(checked)].files[0].path} never read whole: not recorded")
        if not checked:
            return False
        ready = [unit for unit, _ in checked]
        plan = None
        if self.writer is None:
            try:
                plan = self.fmt.plan([c for _, c in checked])
            except Incomplete:
                return False  # not enough read yet to plan the run (verl: validation dumps alone)
        try:
            with session_scope(self.factory) as session:
                if plan is not None:
                    self._create(session, plan)
                assert self.writer is not None
                steps, rollouts = self.writer.write(session, (fmt.record(u) for u in ready))
        except (IntegrityError, DataError) as exc:
            self._forget()
            raise refused(fmt.folder, exc) from exc
        except BaseException:
            self._forget()
            raise
        self.after = ready[-1].step
        self.steps += steps
        self.rollouts += rollouts
        self.active_at = self.beat_at = self.clock()
        self.say(_recorded(ready, rollouts))
        return True

    def _create(self, session: Session, plan: RunPlan) -> None:
        run_id = create_run(session, self.fmt, plan, RunStatus.running)
        store.mark_following(session, run_id=run_id, worker_host=self.host)
        self.run_id, self.name = run_id, plan.name
        self.writer = DumpWriter(run_id, total_steps=self.total_steps)
        self.say(f"created run {run_id} ({plan.name}), following {self.fmt.folder}")

    def _forget(self) -> None:
        """The transaction rolled back: a run it created does not exist."""
        if self.writer is not None:
            self.writer.reset()
        if self.steps == 0 and not self.resumed:
            self.run_id = self.name = self.writer = None

    # -- the run's lifecycle -------------------------------------------------------------------

    def _resume(self) -> None:
        """Take the newest run of this folder, if any, after its last recorded step."""
        folder = str(self.fmt.folder.resolve())
        with session_scope(self.factory) as session:
            run = store.followed_run(
                session, source=self.fmt.source, key=self.fmt.folder_key, folder=folder
            )
            if run is None or self.new:
                return
            self._check_same_training(session, run)
            if run.status == RunStatus.running and run.heartbeat_at is not None:
                age = (utcnow() - utc(run.heartbeat_at)).total_seconds()
                if age < self.lost_after_seconds:
                    raise InvalidInput(
                        f"run {run.id} ({run.name}) is being followed already (its last "
                        f"heartbeat {age:.0f} s ago): stop that follower first"
                    )
            self.fmt.adopt(run)
            self.after = store.last_recorded_step(session, run_id=run.id)
            self.run_id, self.name, self.resumed = run.id, run.name, True
            self.writer = DumpWriter(
                run.id,
                prompts_per_step=run.prompts_per_step,
                total_steps=self.total_steps or run.total_steps,
            )
            store.mark_following(session, run_id=run.id, worker_host=self.host)
        where = "before its first step" if self.after is None else f"after step {self.after}"
        self.say(f"resuming run {self.run_id} ({self.name}) {where}")

    def _check_same_training(self, session: Session, run: RunRow) -> None:
        """Refuse to resume a run whose first step's file was written again after it was
        recorded: the trainer started over in this folder (a new run; verl resuming from a
        checkpoint rewrites only the steps after it)."""
        first = store.first_recorded(session, run_id=run.id)
        if first is None:
            return
        step, at = first
        path = next((f.path for f in self.fmt.scan() if f.step == step), None)
        if path is None:
            return
        written = datetime.fromtimestamp(path.stat().st_mtime, UTC)
        if (written - utc(at)).total_seconds() > REWRITTEN_AFTER:
            raise InvalidInput(
                f"{path} was written again after run {run.id} ({run.name}) recorded it: the "
                "trainer started over in this folder. Pass --new for a new run"
            )

    def _beat(self) -> bool:
        """Beat the heartbeat; whether someone pressed Cancel in the dashboard."""
        assert self.run_id is not None
        with session_scope(self.factory) as session:
            store.heartbeat(session, run_id=self.run_id)
            return store.cancel_requested(session, run_id=self.run_id)

    def _finish(self, status: RunStatus, error: str | None) -> None:
        if self.run_id is not None:
            with session_scope(self.factory) as session:
                store.mark_finished(
                    session,
                    run_id=self.run_id,
                    status=status,
                    error=error,
                    ended_by=EndedBy.recorder,
                )


def _recorded(ready: list[Unit], rollouts: int) -> str:
    first, last = ready[0].step, ready[-1].step
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"recorded {steps} ({rollouts} rollouts)"


def utc(value: datetime) -> datetime:
    """A stored time as aware UTC (SQLite gives it back naive)."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)
