"""Engines and sessions: SQLite pragmas, the web app's pool, one session scope that commits or
rolls back.

SQLite (the embedded default) runs in WAL mode: readers never block the writer or each other, so
fifty dashboard clients polling a run do not stall its recorder, and the recorder's commits do
not stall them; `synchronous=NORMAL` is safe with WAL and saves an fsync per commit; a writer
that finds the file locked (the recorder and the web app's sweeper both write) waits up to
`busy_timeout_ms` (ROLLOUT_LENS_SQLITE_BUSY_TIMEOUT_MS, 30 s) instead of failing with "database
is locked"; the WAL file is cut back to SQLITE_WAL_LIMIT whenever it starts over. bench/load.py
measures this: 50 clients for a minute against a run recording a step every 100 ms, no error and
no lock, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollout_lens.server.core import textsafe
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_PAGE_SIZE = 32768  # bytes a page of a new SQLite file (SQLite's default: 4096)
# The WAL file is cut back to this when a checkpoint lets it start over. Without a limit it keeps
# the size of its longest stretch without one (readers that never pause hold checkpoints off):
# once seen at 5.4 GB beside a 0.6 GB database after a 900-step bench fill.
SQLITE_WAL_LIMIT = 64 * 1024 * 1024

# The web app's pool. FastAPI runs each request's sync handler, with its session, on one of
# anyio's worker threads, 40 at most; the sweeper takes one more connection. A smaller pool (the
# default is 5 + 10 overflow) makes requests beyond 15 queue for a connection under load and fail
# after the pool timeout; a larger one could never be used. 10 stay open between bursts; the 31
# overflow connections are closed when returned. On PostgreSQL that is up to 41 connections per
# web process (its default max_connections is 100); on SQLite each is a file handle and a cache.
WEB_POOL: dict[str, int] = {"pool_size": 10, "max_overflow": 31, "pool_timeout": 30}

# A PostgreSQL link that goes silent (a failover that moves the address, a switch or NAT that
# drops packets without a reset) leaves a connection waiting on an answer until the kernel gives
# up retransmitting: about 15 minutes on Linux (tcp_retries2), during which a recorder's writes,
# a worker's training and a page's request wait. libpq's tcp_user_timeout ends it once sent data
# has gone this long unacknowledged (a slow query sends nothing meanwhile: it is not cut), and
# keepalives find an idle connection's peer gone (and keep middleboxes from dropping it). A
# URL's own values of these (…?tcp_user_timeout=…) win.
PG_LINK_TIMEOUT_S = 60.0
_PG_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10}
# A statement that waits on another session's lock (a table an operator locked and left, a
# transaction left open in psql holding a row, a DDL under way) waited for as long as it was held:
# a recorder's write, and with it a launched run's training once its steps queued up, for ever.
# PostgreSQL's lock_timeout ends the wait with an error past this (SQLite's busy timeout does the
# same for its file lock): the recorder retries, a launched run fails after its grace, a page
# says so. A URL's own lock_timeout (options=-c lock_timeout=...) wins; migrations wait as long
# as they need (server.store.migrate).
PG_LOCK_TIMEOUT_S = 60.0


def make_engine(
    url: str,
    *,
    busy_timeout_ms: int = 30_000,
    link_timeout_s: float = PG_LINK_TIMEOUT_S,
    lock_timeout_s: float = PG_LOCK_TIMEOUT_S,
    **pool: int,
) -> Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys and a busy timeout, PostgreSQL a
    bound on a silent link (`link_timeout_s`, PG_LINK_TIMEOUT_S) and on a wait for another
    session's lock (`lock_timeout_s`, PG_LOCK_TIMEOUT_S). `pool`: QueuePool sizes (the web app
    passes WEB_POOL; workers and the CLI keep SQLAlchemy's defaults)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        link: dict[str, int] = {}
        if parsed.get_backend_name() == "postgresql":
            wanted = _PG_KEEPALIVES | {"tcp_user_timeout": round(link_timeout_s * 1000)}
            link = {k: v for k, v in wanted.items() if k not in parsed.query}
        engine = create_engine(
            url,
            pool_pre_ping=True,
            json_serializer=textsafe.json_dumps,
            connect_args=link,
            **pool,
        )
        textsafe.install(engine)
        if parsed.get_backend_name() == "postgresql":
            own_lock = "lock_timeout" in str(parsed.query.get("options", ""))
            lock_ms = None if own_lock else round(lock_timeout_s * 1000)
            event.listen(engine, "connect", functools.partial(_postgres_settings, lock_ms))
        return engine
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"timeout": busy_timeout_ms / 1000},
        json_serializer=textsafe.json_dumps,
        **(pool if parsed.database and parsed.database != ":memory:" else {}),
    )
    textsafe.install(engine)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        # A new file's pages (an existing one keeps its own): a rollout's arrays are a few KB,
        # and SQLite never splits a row smaller than a page, so 4 KB pages held one rollout
        # each with a quarter of the page empty; 32 KB pages hold ten.
        cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL, far fewer fsyncs
        cursor.execute(f"PRAGMA journal_size_limit={SQLITE_WAL_LIMIT}")
        cursor.close()

    return engine


def _postgres_settings(lock_ms, dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    """Each new PostgreSQL connection: no JIT compilation, a plan for each statement's own
    values, and a bound of `lock_ms` on a wait for a lock (PG_LOCK_TIMEOUT_S; None: the URL's).

    The store's statements are a page's or a step's, meant to take milliseconds, and past
    jit_above_cost (a cost, not a time: a walk of a run's 512,000 rollouts that stops at its
    LIMIT is costed as the whole walk) PostgreSQL spent more compiling than running: 61 of the
    137 ms of the count of `ves*` at 1,000 full-shape steps (explorer `q=`: 227 → 170 ms, `need`
    104 → 73 ms).

    psycopg prepares a statement that a connection has run 5 times, and after 5 more PostgreSQL
    may keep one generic plan for it, made without its values. A search's are constant arrays
    of word numbers and ids, which only a plan that sees them hashes: the prompts of a prefix of
    2,000 words at 100 full steps went from 19 ms to 1.3 s on a page's 11th request (each
    prompt's words compared with every number)."""
    with dbapi_connection.cursor() as cursor:
        cursor.execute("SET jit = off")
        cursor.execute("SET plan_cache_mode = force_custom_plan")
        if lock_ms is not None:
            cursor.execute(f"SET lock_timeout = {int(lock_ms)}")
    dbapi_connection.commit()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit on success, roll back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
