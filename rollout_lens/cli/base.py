"""What every command shares: the error line and its exit status, settings' and SQLite's messages,
the database opened for reading or migrated for writing, the ML stack's presence. Commands import
this module, never the entry point (rollout_lens.cli)."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import RolloutLensError
from rollout_lens.server.core.textsafe import printable
from rollout_lens.server.store.db import make_engine, make_session_factory


def fail(message: str, *, status: int = 2) -> int:
    """Print `message` as the command's error line; returns the exit status."""
    print(f"rollout-lens: error: {printable(message)}", file=sys.stderr)
    return status


def validation_text(exc: ValidationError) -> str:
    """Each error as `field: message`; a rule across fields names them in its message."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def is_locked(exc: OperationalError) -> bool:
    """SQLite's answer when another writer kept its lock past the busy timeout."""
    return "database is locked" in str(exc.orig)


def locked_message(settings: Settings, *, waited: bool) -> str:
    """What a person needs about SQLite's write lock: which file, held by whom, for how long."""
    path = make_url(settings.database_url).database
    seconds = settings.sqlite_busy_timeout_ms / 1000
    if not waited:
        return (
            f"the database {path} is locked by another writer (a training run, an import): "
            f"waiting up to {seconds:g} s for its lock (ROLLOUT_LENS_SQLITE_BUSY_TIMEOUT_MS)"
        )
    return (
        f"the database {path} stayed locked by another writer (a training run, an import) for "
        f"{seconds:g} s (ROLLOUT_LENS_SQLITE_BUSY_TIMEOUT_MS); nothing was written: try again "
        "when it is done"
    )


def _say_if_locked(settings: Settings) -> None:
    """Say at once when another process holds the SQLite file's write lock, rather than wait
    the busy timeout in silence (the wait itself is the driver's)."""
    import sqlite3

    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or not Path(url.database).exists():
        return
    probe = sqlite3.connect(url.database, timeout=0.2, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            print(f"rollout-lens: {locked_message(settings, waited=False)}", file=sys.stderr)
    finally:
        probe.close()


def migrated_factory(settings: Settings):  # type: ignore[no-untyped-def]
    """The engine and session factory of a database migrated to the latest schema (a write)."""
    from rollout_lens.server.store.migrate import upgrade

    _say_if_locked(settings)
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    upgrade(engine)
    return engine, make_session_factory(engine)


def _no_database_here(settings: Settings) -> str | None:
    """Why reading the local database makes no sense: an SQLite file that does not exist (a
    read creates nothing)."""
    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    if Path(url.database).exists():
        return None
    return (
        f"no Rollout Lens database here: {url.database} does not exist. Run this in the folder "
        "where runs were recorded, point ROLLOUT_LENS_DATABASE_URL at a database, or read a "
        "dashboard with --url URL (ROLLOUT_LENS_URL)"
    )


def open_factory(settings: Settings):  # type: ignore[no-untyped-def]
    """The engine and session factory of an existing database at the latest schema (a read)."""
    from rollout_lens.server.store.migrate import ensure_current

    problem = _no_database_here(settings)
    if problem:
        raise RolloutLensError(problem)
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    ensure_current(engine)
    return engine, make_session_factory(engine)


def train_extra_missing(doing: str, *, extras: str = "train") -> str | None:
    """What to install, where `doing` needs the ML stack and this install lacks it (a
    dashboard-only install); None where it is here."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "trl") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"{doing} needs {', '.join(missing)}: pip install 'rollout-lens[{extras}]'"
        " (the dashboard alone does not)"
    )
