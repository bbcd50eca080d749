"""Runs recorded over HTTP (/api/record): a trainer's steps written through the store's one
writer (store.RunWriter: the same as a local recording's and every import's).

A run is created under the recorder's own key (a create retried after a lost answer finds the
run it made) and belongs to the token that created it: a recording token writes only to its own
runs (a full access token to any recorded run). A body of steps is checked whole
(server.exchange.wire) before anything is written; steps the run has already are answered as
`already` and not written again (a retry after a lost answer), the others in one transaction of
their own. Each run's RunWriter (what its next write needs: rollup buckets, alert windows,
token texts) is kept between requests, checked against the run's last recorded step and record
epoch before each use and dropped with a transaction that does not commit.

A trainer resumed from a checkpoint creates with `resume_step` (server.store.resume: the run's
steps after it go, its record epoch goes up); a body sent under an older epoch comes from the
process the resume replaced (Superseded). A body is checked and written under the run's lock
(store.lock_run): bodies of one run go one at a time, across web processes too. A step the run
does not have that comes before its last is refused whole (StepOutOfOrder) and said, bounded, in
the run's notes (store.note_refusal), as is a body the wire refuses and a step whose rollouts
were generated at a step whose rollouts the run has (RolloutsTaken): both are 409s naming the
step, which the recorder drops alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.errors import (
    InvalidInput,
    InvalidState,
    NotFound,
    StepOutOfOrder,
    StepRefused,
)
from rollout_lens.server.store import ending
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunSource, RunStatus
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

KEPT_WRITERS = 64  # runs whose writer state is kept between requests
WRITING_AT_ONCE = 2  # bodies read, decoded and written at once by one web process


class Busy(Exception):
    """As many bodies as WRITING_AT_ONCE are being read or written: a 503 before the body is
    read, the recorder retries."""


class Forbidden(Exception):
    """A token that may not do this (a 403)."""


class Superseded(Exception):
    """A recorder whose run a resumed trainer continues now (an older record epoch): a 409
    whose `status` is `superseded`; that recorder stops, its training goes on."""


@dataclass
class Caller:
    """Who is recording: the token's scope (`full`, `record`, or None when the dashboard has no
    tokens) and its fingerprint (the Guard's: a SHA-256 of the token, never the token); `key`:
    the run's key as the recorder sends it (X-Record-Key), if it does."""

    scope: str | None
    token_fp: str | None
    key: str | None = None

    def may_write(self, run: RunRow) -> bool:
        if run.record_key is None:
            return False
        if self.scope in (None, "full"):
            return True
        return run.recorded_by is not None and run.recorded_by == self.token_fp


@dataclass
class Checked:
    """A run that a body of steps may be written to (Ingest.check): its row, its control
    tokens, and the answer when the sender's claimed steps are all there already."""

    run: RunRow
    control_tokens: list[str]
    answer: dict[str, Any] | None


@dataclass
class _Kept:
    writer: store.RunWriter
    last_step: int | None  # the last step this writer committed
    lock: threading.Lock
    epoch: int | None = None  # the run's record epoch when it did


class Ingest:
    """The web app's recording side (one per app)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        price_per_hour: float,
        max_bytes: int = 64 * 2**20,
    ) -> None:
        self.factory = factory
        self.price_per_hour = price_per_hour
        self.max_bytes = max_bytes  # a body's cap (ROLLOUT_LENS_RECORD_MAX_MB): bounds decoding
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        # bodies read, decoded and written at once (past it a 503 before reading: Busy)
        self.writing = threading.BoundedSemaphore(WRITING_AT_ONCE)

    @property
    def engine(self) -> Engine:
        engine: Engine = self.factory.kw["bind"]
        return engine

    # -- runs ------------------------------------------------------------------------------------

    def create_run(self, caller: Caller, spec: Mapping[str, Any]) -> tuple[RunRow, bool]:
        """The run of `spec["key"]`: found (False) or created running (True)."""
        try:
            return self._find_or_create_run(caller, spec)
        except IntegrityError:
            # Two creates of one key at once (a recorder's retry racing its first try): both
            # saw no run, the one whose key landed second rolled back. It finds the first's.
            return self._find_or_create_run(caller, spec)

    def _find_or_create_run(self, caller: Caller, spec: Mapping[str, Any]) -> tuple[RunRow, bool]:
        with session_scope(self.factory) as session:
            run = store.recorded_run(session, key=spec["key"])
            if run is not None:
                if not caller.may_write(run):
                    raise Forbidden(f"run {run.id} was recorded with another token")
                if spec.get("resume_step") is not None:
                    self._resume(session, run, spec)
                session.expunge(run)
                return run, False
            run = store.create_run(
                session,
                name=store.unique_run_name(session, name=spec["name"]),
                model=spec["model"],
                total_steps=spec["total_steps"],
                group_size=spec["group_size"],
                prompts_per_step=spec["prompts_per_step"],
                seed=spec["seed"],
                config=spec["config"],
                control_tokens=spec["control_tokens"],
                status=RunStatus.running,
                source=RunSource.callback,
                notes=spec["notes"],
                keep_tokens_every=spec["keep_tokens_every"],
            )
            store.mark_running(
                session,
                run_id=run.id,
                worker_host=spec["worker_host"],
                device=spec["device"],
                control_tokens=spec["control_tokens"],
            )
            store.set_record_owner(
                session, run_id=run.id, key=spec["key"], recorded_by=caller.token_fp
            )
            session.flush()
            session.refresh(run)
            session.expunge(run)
            return run, True

    def _resume(self, session: Session, run: RunRow, spec: Mapping[str, Any]) -> None:
        """The run's trainer resumed from its checkpoint: it continues the run (store.resume_run)
        and the writer kept for it is stale."""
        store.resume_run(
            session,
            run_id=run.id,
            after_step=spec["resume_step"],
            worker_host=spec["worker_host"] or None,
            device=spec["device"] or None,
        )
        with self._lock:
            self._kept.pop(run.id, None)

    def heartbeat(
        self,
        caller: Caller,
        run_id: int,
        *,
        dropped: tuple[int, int] | None = None,
        epoch: int | None = None,
    ) -> None:
        """The recorder is alive: a run the sweeper marked lost runs again; RunEnded (a 409 with
        the status) for one that ended otherwise (server/store/ending.py)."""
        with session_scope(self.factory) as session:
            run = _owned_run(session, caller, run_id)
            _current(run, epoch)
            ending.recorder_alive(session, run_id=run_id)
            if dropped is not None:
                store.set_dropped(session, run_id=run_id, steps=dropped[0], rollouts=dropped[1])

    def finish(
        self,
        caller: Caller,
        run_id: int,
        *,
        status: RunStatus,
        error: str | None,
        dropped: tuple[int, int] | None = None,
        epoch: int | None = None,
    ) -> None:
        """The recorder ends its run; RunEnded for a run that ended otherwise, unless the finish
        repeats its status (answered as done)."""
        with session_scope(self.factory) as session:
            _current(_owned_run(session, caller, run_id), epoch)
            ending.finish_recorded(session, run_id=run_id, status=status, error=error)
            if dropped is not None:
                store.set_dropped(session, run_id=run_id, steps=dropped[0], rollouts=dropped[1])
        with self._lock:
            self._kept.pop(run_id, None)

    @contextlib.contextmanager
    def slot(self, what: str) -> Iterator[None]:
        """One of the WRITING_AT_ONCE slots, held while a body is read, decoded and written
        (a body of steps, an export file): Busy when none is free, before the body is read
        (the route takes the slot first), so that a busy dashboard holds and reads no body."""
        if not self.writing.acquire(blocking=False):
            raise Busy(f"the dashboard is writing other recordings: send {what} again shortly")
        try:
            yield
        finally:
            self.writing.release()

    def import_file(self, data: bytes, *, name: str | None, moved: bool) -> dict[str, Any]:
        """An export file (JSONL or Parquet) sent whole: imported as `rollout-lens import` does,
        in one transaction (server.exchange.importer), within the decode bound of its byte cap.
        Called within slot() (the route reads the file after taking it)."""
        return import_upload(self.factory, data, name=name, moved=moved, max_bytes=self.max_bytes)

    # -- steps -----------------------------------------------------------------------------------

    def check(
        self, caller: Caller, run_id: int, *, claimed: Sequence[int] = (), epoch: int | None = None
    ) -> Checked:
        """What a body of steps needs no body for: the run may be written by this caller, is
        recording, and the sender is current; `claimed`: the steps the sender says the body
        holds (a retry whose first attempt was written is answered from them, undecoded, and
        without a slot: the claim can only make the run skip its own steps); `epoch`: the
        record epoch the sender's create answered (None: not checked)."""
        with session_scope(self.factory) as session:
            run = _owned_run(session, caller, run_id)  # before anything is read or decoded
            if not ending.may_record(run):  # cancelled, finished: a 409 the recorder stops at
                raise ending.ended(run)
            _current(run, epoch)
            control_tokens = list(run.control_tokens or [])
            if claimed:
                present = store.present_steps(session, run_id=run_id, steps=claimed)
                if present == set(claimed):
                    answer = {"run_id": run_id, "written": [], "already": sorted(present)}
                    return Checked(run, control_tokens, answer | {"rollouts": 0})
        return Checked(run, control_tokens, None)

    def write(
        self,
        checked: Checked,
        body: bytes,
        *,
        dropped: tuple[int, int] | None = None,
        claimed: Sequence[int] = (),
        epoch: int | None = None,
    ) -> dict[str, Any]:
        """Check the body whole, then write the steps the run does not have yet (of a run
        `check` passed, within slot())."""
        run_id = checked.run.id
        try:
            return self._write(
                checked.run,
                body,
                dropped=dropped,
                control_tokens=checked.control_tokens,
                epoch=epoch,
            )
        except StepRefused as exc:  # out of order, or rollouts the run has (RolloutsTaken)
            self._note_refusal(run_id, f"step {exc.step}", str(exc))
            raise
        except InvalidInput as exc:  # the wire's refusals (WireInvalid)
            said = f"steps {_listed(claimed)}" if claimed else "a body of steps"
            self._note_refusal(run_id, said, str(exc))
            raise

    def _note_refusal(self, run_id: int, what: str, why: str) -> None:
        with session_scope(self.factory) as session:
            store.note_refusal(session, run_id=run_id, what=what, why=why)

    def _write(
        self,
        run: RunRow,
        body: bytes,
        *,
        dropped: tuple[int, int] | None,
        control_tokens: list[str],
        epoch: int | None,
    ) -> dict[str, Any]:
        from rollout_lens.server.exchange import wire  # pyarrow: loaded on the first recording

        run_id = run.id
        budget = wire.Budget.of(self.max_bytes)
        received = wire.decode_body(body, control_tokens=control_tokens, budget=budget)
        steps = [r.record.step for r in received]
        if len(set(steps)) != len(steps):
            raise wire.WireInvalid("steps", "a step sent twice in one request")
        kept = self._writer(run_id, control_tokens)
        with kept.lock:  # one body of a run at a time here; the run's row lock across processes
            try:
                with session_scope(self.factory) as session:
                    fresh, already, last = self._fresh(session, kept, run_id, received, epoch)
                    if fresh:
                        texts = kept.writer.token_texts(session.connection())

                        def known(ids: Sequence[int]) -> dict[int, str]:
                            return {i: t for i in ids if (t := texts.get(i)) is not None}

                        wire.complete_tokens(fresh, known, budget=budget)
                        kept.writer.write_charged(session.connection(), [r.record for r in fresh])
                    if dropped is not None:
                        store.set_dropped(
                            session, run_id=run_id, steps=dropped[0], rollouts=dropped[1]
                        )
            except (StepOutOfOrder, Superseded, InvalidState, NotFound):
                raise  # refused before anything was written: the kept writer stands
            # (RolloutsTaken, from the store's writer, may come after the body's earlier steps
            # were written in the transaction: the writer is reset below)
            except BaseException:
                kept.writer.reset()
                kept.last_step = kept.epoch = None
                raise
            kept.last_step = max(
                [*([last] if last is not None else []), *steps_of(fresh)], default=None
            )
            kept.writer.index_written(self.engine)
        return {
            "run_id": run_id,
            "written": steps_of(fresh),
            "already": sorted(already),
            "rollouts": sum(len(r.record.rollouts) for r in fresh),
        }

    @staticmethod
    def _fresh(
        session: Session, kept: _Kept, run_id: int, received: Sequence[Any], epoch: int | None
    ) -> tuple[list[Any], set[int], int | None]:
        """Under the run's lock: the received steps to write, those the run has already and its
        last step. Refuses a superseded sender and a step that comes before the
        run's last; forgets the kept writer if another process or a resume wrote since."""
        locked = store.lock_run(session, run_id=run_id)
        if locked is None:
            raise NotFound(f"run {run_id} does not exist")
        _, current = locked
        if epoch is not None and epoch < current:
            raise Superseded(_SUPERSEDED.format(run_id=run_id))
        # under the row's lock: a run the dashboard cancelled meanwhile is a 409 (RunEnded),
        # not steps after the cancel; a run the sweeper marked lost runs again
        ending.recorder_alive(session, run_id=run_id)
        steps = [r.record.step for r in received]
        already = store.present_steps(session, run_id=run_id, steps=steps)
        last = store.last_recorded_step(session, run_id=run_id)
        if (last, current) != (kept.last_step, kept.epoch):
            kept.writer.reset()  # its memory is of other writes: rebuilt from the database
            kept.epoch = current
        fresh = [r for r in received if r.record.step not in already]
        top = last
        for step in steps_of(fresh):  # steps only rise: after the run's last and in the body
            if top is not None and step < top:
                raise StepOutOfOrder(step=step, last=top)
            top = step
        return fresh, already, last

    def _writer(self, run_id: int, control_tokens: list[str]) -> _Kept:
        with self._lock:
            kept = self._kept.get(run_id)
            if kept is None:
                writer = store.RunWriter(
                    run_id, control_tokens=control_tokens, price_per_hour=self.price_per_hour
                )
                kept = self._kept[run_id] = _Kept(writer, None, threading.Lock())
                while len(self._kept) > KEPT_WRITERS:
                    self._kept.popitem(last=False)
            self._kept.move_to_end(run_id)
            return kept


_SUPERSEDED = (
    "run {run_id} is continued by a trainer resumed from a checkpoint since this recorder "
    "started: it records nothing more (its training goes on)"
)


def import_upload(
    factory: sessionmaker[Session], data: bytes, *, name: str | None, moved: bool, max_bytes: int
) -> dict[str, Any]:
    """An uploaded export file imported from a file of its own (its path never in a message)."""
    import tempfile
    from pathlib import Path

    from rollout_lens.server.core.errors import InvalidInput
    from rollout_lens.server.exchange.importer import import_export

    with tempfile.TemporaryDirectory(prefix="rollout-lens-import-") as folder:
        path = Path(folder) / "upload"
        path.write_bytes(data)
        try:
            done = import_export(factory, path, name=name, moved=moved, max_bytes=max_bytes)
        except InvalidInput as exc:
            raise InvalidInput(str(exc).replace(str(path), "the uploaded file")) from None
    return {"id": done.run_id, "name": done.name, "steps": done.steps, "rollouts": done.rollouts}


def _owned_run(session: Session, caller: Caller, run_id: int) -> RunRow:
    """The run this caller may write to; NotFound or Forbidden otherwise."""
    run = store.get_run(session, run_id=run_id)
    if caller.key is not None and run.record_key is not None and run.record_key != caller.key:
        # SQLite gives a deleted run's id to the next run made: not the recorder's run
        raise NotFound(f"run {run_id} does not exist (the run this recorder made was deleted)")
    if not caller.may_write(run):
        if run.record_key is None:
            raise Forbidden(f"run {run_id} was not created by a recorder: nothing records it")
        raise Forbidden(f"run {run_id} was recorded with another token")
    return run


def _current(run: RunRow, epoch: int | None) -> None:
    """Refuse a recorder the run's latest resume replaced (an epoch before the run's)."""
    if epoch is not None and epoch < run.record_epoch:
        raise Superseded(_SUPERSEDED.format(run_id=run.id))


def _step(received: Any) -> int:
    return int(received.record.step)


def steps_of(received: Sequence[Any]) -> list[int]:
    return [_step(r) for r in received]


def _listed(steps: Sequence[int]) -> str:
    shown = ", ".join(str(s) for s in list(steps)[:8])
    return shown + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
