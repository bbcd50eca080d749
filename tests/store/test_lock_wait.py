"""A PostgreSQL write that waits on another session's lock (a table locked and left, a transaction
left open holding it, a DDL under way) waited for as long as the lock was held: a recorder's
write for ever, and with it a launched run's training once its steps queued up. The store's
connections end such a wait at `lock_timeout_s` (PostgreSQL's lock_timeout, as SQLite's busy
timeout ends a wait for its file); the recorder retries and writes every step once the lock is
gone; migrations still wait as long as they need."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
from rollout_lens.server.store.db import PG_LOCK_TIMEOUT_S, make_engine
from rollout_lens.server.store.migrate import upgrade
from sqlalchemy import Connection, Engine, make_url, text
from sqlalchemy.exc import OperationalError

from tests.factories import assert_every_step_written, script_writer, seeded_step
from tests.waiting import returns, until

pytestmark = pytest.mark.postgres


@pytest.fixture
def holder(pg_engine: Engine) -> Iterator[Callable[[str], Connection]]:
    """Another session that takes a table's ACCESS EXCLUSIVE lock and keeps its transaction
    open (`hold(table)`), rolled back at the end."""
    conn = pg_engine.connect()

    def hold(table: str) -> Connection:
        conn.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        return conn

    try:
        yield hold
    finally:
        conn.rollback()
        conn.close()


def test_a_wait_for_a_lock_ends_within_the_bound(
    pg_database_url: str, holder: Callable[[str], Connection]
) -> None:
    engine = make_engine(pg_database_url, lock_timeout_s=0.5)
    held = holder("runs")
    try:
        with engine.connect() as conn:
            try:
                with pytest.raises(OperationalError, match="lock timeout"):
                    # the hang detector's bound: well past 0.5 s, short of for ever
                    returns(lambda: conn.execute(text("SELECT 1 FROM runs")), "a locked read", 30)
            finally:
                held.rollback()  # else a read left waiting waits on its close too
    finally:
        engine.dispose()


def test_the_bound_is_set_and_a_urls_own_value_wins(pg_database_url: str) -> None:
    engine = make_engine(pg_database_url)
    own = make_engine(
        make_url(pg_database_url)
        .update_query_dict({"options": "-c lock_timeout=1234"})
        .render_as_string(hide_password=False)
    )
    try:
        with engine.connect() as conn, own.connect() as mine:
            ms = text("SELECT setting FROM pg_settings WHERE name = 'lock_timeout'")
            assert conn.execute(ms).scalar() == str(round(PG_LOCK_TIMEOUT_S * 1000))
            assert mine.execute(ms).scalar() == "1234"
    finally:
        engine.dispose()
        own.dispose()


def test_a_migration_waits_for_its_locks(
    pg_database_url: str, holder: Callable[[str], Connection]
) -> None:
    """A migration is not cut at the bound: it waits for the lock another session holds on
    alembic_version (which every migration reads first), and goes on once it is let go."""
    engine = make_engine(pg_database_url, lock_timeout_s=0.2)
    conn = holder("alembic_version")
    done: list[BaseException | None] = []

    def migrate() -> None:
        try:
            upgrade(engine)  # at head already: it reads the version, waiting on the lock
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test says it
            done.append(exc)

    thread = threading.Thread(target=migrate, daemon=True)
    try:
        thread.start()
        thread.join(1.5)  # several bounds: a migration cut at the bound has failed by now
        assert not done, done
        conn.rollback()  # the lock let go
        thread.join(60)
        assert done == [None]
    finally:
        conn.rollback()
        engine.dispose()


def test_a_scripts_recorder_outlives_a_lock_held_on_its_tables(
    pg_database_url: str,
    _pg_reset: Callable[[], None],
    holder: Callable[[str], Connection],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock on the rollouts table held past the bound (here the URL's own, 0.5 s): the
    recorder's write of step 2 ends with the lock's error, the steps wait in the budget, and all
    of them are written once the lock is let go, nothing dropped (the writer's child, the
    default)."""
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    _pg_reset()
    url = make_url(pg_database_url).update_query_dict({"options": "-c lock_timeout=500"})
    writer = script_writer(
        url.render_as_string(hide_password=False), "locked", total_steps=5, process=True
    )
    writer.put(seeded_step(1))
    until(lambda: writer.written_steps == 1, "step 1 written")
    held = holder("rollouts")
    try:
        for n in range(2, 6):
            writer.put(seeded_step(n))
        until(lambda: "lock timeout" in caplog.text, "the lock's error said")
        assert writer.written_steps == 1
    finally:
        held.rollback()  # the lock let go
    assert writer.close() is True
    assert_every_step_written(pg_database_url, writer.run_id, 5)
