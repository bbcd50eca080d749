"""Runs recorded over HTTP (/api/record): a trainer's steps written through the store's one
writer (store.RunWriter: the same as a local recording's and every import's).

A run is created under the recorder's own key (a create retried after a lost answer finds the
run it made) and belongs to the token that created it: a recording token writes only to its own
runs (a full access token to any recorded run). A body of steps is checked whole
(server.exchange.wire) before anything is written; steps the run has already are answered as
`already` and not written again (a retry after a lost answer), the others in one transaction of
their own. Each run's RunWriter (what its next write needs: rollup buckets, alert windows,
token texts) is kept between requests, checked against the run's last recorded step before
each use and dropped with a transaction that does not commit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidState, NotFound
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunSource, RunStatus
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

KEPT_WRITERS = 64  # runs whose writer state is kept between requests
WRITING_AT_ONCE = 2  # bodies of steps decoded and written at once by one web process


class Busy(Exception):
    """As many bodies as WRITING_AT_ONCE are being written: a 503, the recorder retries."""


class Forbidden(Exception):
    """A token that may not do this (a 403)."""


@dataclass
class Caller:
    """Who is recording: the token's scope (`full`, `record`, or None when the dashboard has no
    tokens) and its fingerprint (the Guard's: a SHA-256 of the token, never the token)."""

    scope: str | None
    token_fp: str | None

    def may_write(self, run: RunRow) -> bool:
        if run.record_key is None:
            return False
        if self.scope in (None, "full"):
            return True
        return run.recorded_by is not None and run.recorded_by == self.token_fp


@dataclass
class _Kept:
    writer: store.RunWriter
    last_step: int | None  # the last step this writer committed
    lock: threading.Lock


class Ingest:
    """The web app's recording side (one per app)."""

    def __init__(self, factory: sessionmaker[Session], *, price_per_hour: float) -> None:
        self.factory = factory
        self.price_per_hour = price_per_hour
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        # bodies decoded and written at once (a body past it is answered 503: Busy)
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

    def _run(self, session: Session, caller: Caller, run_id: int) -> RunRow:
        try:
            run = store.get_run(session, run_id=run_id)
        except NotFound:
            raise
        if not caller.may_write(run):
            if run.record_key is None:
                raise Forbidden(f"run {run_id} was not created by a recorder: nothing records it")
            raise Forbidden(f"run {run_id} was recorded with another token")
        return run

    def heartbeat(
        self, caller: Caller, run_id: int, *, dropped: tuple[int, int] | None = None
    ) -> None:
        with session_scope(self.factory) as session:
            run = self._run(session, caller, run_id)
            if run.status == RunStatus.lost:
                store.revive(session, run_id=run_id)
            store.heartbeat(session, run_id=run_id)
            if dropped is not None:
                store.set_dropped(session, run_id=run_id, steps=dropped[0], rollouts=dropped[1])

    def finish(self, caller: Caller, run_id: int, *, status: RunStatus, error: str | None) -> None:
        with session_scope(self.factory) as session:
            self._run(session, caller, run_id)
            store.mark_finished(session, run_id=run_id, status=status, error=error)
        with self._lock:
            self._kept.pop(run_id, None)

    def import_file(self, data: bytes, *, name: str | None, moved: bool) -> dict[str, Any]:
        """An export file (JSONL or Parquet) sent whole: imported as `rollout-lens import` does,
        in one transaction (server.exchange.importer)."""
        import tempfile
        from pathlib import Path

        from rollout_lens.server.core.errors import InvalidInput
        from rollout_lens.server.exchange.importer import import_export

        with tempfile.TemporaryDirectory(prefix="rollout-lens-import-") as folder:
            path = Path(folder) / "upload"
            path.write_bytes(data)
            try:
                done = import_export(self.factory, path, name=name, moved=moved)
            except InvalidInput as exc:
                raise InvalidInput(str(exc).replace(str(path), "the uploaded file")) from None
        return {
            "id": done.run_id,
            "name": done.name,
            "steps": done.steps,
            "rollouts": done.rollouts,
        }

    # -- steps -----------------------------------------------------------------------------------

    def write(
        self,
        caller: Caller,
        run_id: int,
        body: bytes,
        *,
        dropped: tuple[int, int] | None = None,
        claimed: Sequence[int] = (),
    ) -> dict[str, Any]:
        """Check the body whole, then write the steps the run does not have yet. `claimed`:
        the steps the sender says the body holds (a retry whose first attempt was written is
        answered from them, undecoded: the claim can only make the run skip its own steps)."""
        with session_scope(self.factory) as session:
            run = self._run(session, caller, run_id)  # before anything is decoded
            if run.status in (RunStatus.completed, RunStatus.failed, RunStatus.cancelled):
                raise InvalidState(f"run {run_id} is {run.status}: it records nothing more")
            control_tokens = list(run.control_tokens or [])
            if claimed:
                present = store.present_steps(session, run_id=run_id, steps=claimed)
                if present == set(claimed):
                    return {
                        "run_id": run_id,
                        "written": [],
                        "already": sorted(present),
                        "rollouts": 0,
                    }
        if not self.writing.acquire(blocking=False):
            raise Busy("the dashboard is writing other recordings: send these again shortly")
        try:
            return self._write(caller, run, body, dropped=dropped, control_tokens=control_tokens)
        finally:
            self.writing.release()

    def _write(
        self,
        caller: Caller,
        run: RunRow,
        body: bytes,
        *,
        dropped: tuple[int, int] | None,
        control_tokens: list[str],
    ) -> dict[str, Any]:
        from rollout_lens.server.exchange import wire  # pyarrow: loaded on the first recording

        run_id = run.id
        received = wire.decode_body(body, control_tokens=control_tokens)
        steps = [r.record.step for r in received]
        if len(set(steps)) != len(steps):
            raise wire.WireInvalid("steps", "a step sent twice in one request")
        kept = self._writer(run_id, control_tokens)
        with kept.lock:
            with session_scope(self.factory) as session:
                already = store.present_steps(session, run_id=run_id, steps=steps)
                last = store.last_recorded_step(session, run_id=run_id)
            if last != kept.last_step:
                kept.writer.reset()  # another process wrote to it: rebuilt from the database
            fresh = [r for r in received if r.record.step not in already]
            if fresh:
                texts = kept.writer.token_texts(self.engine)

                def known(ids: Sequence[int]) -> dict[int, str]:
                    return {i: t for i in ids if (t := texts.get(i)) is not None}

                wire.complete_tokens(fresh, known)
                try:
                    kept.writer.commit(self.engine, [r.record for r in fresh])
                except BaseException:
                    kept.writer.reset()
                    kept.last_step = None
                    raise
                kept.last_step = max(last or 0, *(r.record.step for r in fresh))
            else:
                kept.last_step = last
        with session_scope(self.factory) as session:
            if run.status == RunStatus.lost:
                store.revive(session, run_id=run_id)
            if dropped is not None:
                store.set_dropped(session, run_id=run_id, steps=dropped[0], rollouts=dropped[1])
        return {
            "run_id": run_id,
            "written": [r.record.step for r in fresh],
            "already": sorted(already),
            "rollouts": sum(len(r.record.rollouts) for r in fresh),
        }

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
