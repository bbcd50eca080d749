"""SQLite's WAL file gives its space back: after a stretch in which a reader held checkpoints off
(the file grows with every commit meanwhile), the first checkpoint that lets it start over cuts
it to SQLITE_WAL_LIMIT (server.store.db)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from rollout_lens.server.store import db
from sqlalchemy import text


def test_the_wal_is_cut_back_once_readers_let_it_start_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "SQLITE_WAL_LIMIT", 1 << 20)  # 1 MB: the test writes 8
    path = tmp_path / "wal.db"
    engine = db.make_engine(f"sqlite:///{path}")
    wal = Path(f"{path}-wal")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE blobs (b BLOB)"))
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM blobs").fetchone()  # holds its snapshot
    for _ in range(8):
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO blobs VALUES (randomblob(1048576))"))
    grown = wal.stat().st_size
    assert grown > 8 << 20  # nothing could be checkpointed past the reader's snapshot
    reader.execute("COMMIT")
    reader.close()
    with engine.begin() as conn:
        conn.execute(text("PRAGMA wal_checkpoint(PASSIVE)"))
    with engine.begin() as conn:  # starts the WAL over: cut back to the limit
        conn.execute(text("INSERT INTO blobs VALUES (x'00')"))
    assert wal.stat().st_size <= 1 << 20
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM blobs")).scalar() == 9
    engine.dispose()
