"""Alembic builds the schema; models and migrations agree; SQLite gets its pragmas."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from server.db import make_engine
from server.errors import DatabaseBehind
from server.migrate import current_revision, ensure_current, head_revision, upgrade
from server.models import Base


def test_upgrade_head_matches_models(engine) -> None:
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_empty_database_is_refused_until_upgraded(sqlite_url) -> None:
    engine = make_engine(sqlite_url)
    with pytest.raises(DatabaseBehind, match="rollout-lens db upgrade"):
        ensure_current(engine)
    upgrade(engine)
    ensure_current(engine)
    upgrade(engine)  # idempotent
    engine.dispose()


def test_sqlite_pragmas(sqlite_url) -> None:
    engine = make_engine(sqlite_url, busy_timeout_ms=1234)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 1234
    engine.dispose()
