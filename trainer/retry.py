"""A launched run rides out a database that goes away: retry with backoff, then fail clearly.

The TRL callback's outbox (trainer/outbox.py) keeps training and buffers; a launched run instead
pauses (its writer's queue fills and the trainer waits) while the database is away — PostgreSQL
restarting, a network cut, SQLite locked, a full disk — retrying with the outbox's backoff and its
idea of what is transient. A step is written exactly once and in order: one the database took
but whose answer was lost is recognised on the retry (IntegrityError), and a step that cannot be
written stops the run there, so the recorded steps never have a gap. After `give_up_after`
seconds (the run's ROLLOUT_LENS_LOST_AFTER_SECONDS: the dashboard calls a silent worker lost
then too) the error is raised with a message that says what failed and for how long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rollout_lens.server import store
from rollout_lens.server.db import session_scope
from rollout_lens.trainer.outbox import RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS, _is_transient
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("rollout_lens")

T = TypeVar("T")


class DatabaseAway(RuntimeError):
    """The database stayed unreachable (or unwritable) for longer than the caller waits."""


def with_retries(
    action: Callable[[bool], T],
    *,
    what: str,
    give_up_after: float,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`action(retried)` until it succeeds; transient database errors are retried with backoff
    for at most `give_up_after` seconds, then DatabaseAway is raised. `retried` tells the action
    that an earlier attempt may have committed without its answer arriving."""
    delay, down_since, attempts = RETRY_FIRST_SECONDS, None, 0
    while True:
        try:
            result = action(attempts > 0)
        except DBAPIError as exc:
            if not _is_transient(exc):
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
                log.error("Rollout Lens: %s failed after %.0f s: %s", what, waited, short(exc))
                raise DatabaseAway(
                    f"{what} failed: the database could not be written for {waited:.0f} s "
                    f"({attempts} attempts): {short(exc)}"
                ) from exc
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


FINISH_GIVE_UP_SECONDS = 60.0  # at least: a run's end (and why) is worth waiting for


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
