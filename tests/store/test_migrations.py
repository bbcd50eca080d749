"""Alembic builds the schema; models and migrations agree; SQLite gets its pragmas."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from rollout_lens.server.core.errors import DatabaseBehind
from rollout_lens.server.store.db import make_engine
from rollout_lens.server.store.migrate import (
    current_revision,
    ensure_current,
    head_revision,
    is_modelled,
    upgrade,
)
from rollout_lens.server.store.models import Base
from sqlalchemy import text


def test_upgrade_head_matches_models(engine) -> None:
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": is_modelled})
        diff = compare_metadata(context, Base.metadata)
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


def test_rollup_migration_backfills_existing_runs(sqlite_url) -> None:
    engine = make_engine(sqlite_url)
    upgrade(engine, "0002")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (id, name, status, model, group_size, prompts_per_step, seed, total_steps,"
                " config, control_tokens, created_at, device_seconds, cost, current_step, cancel_requested)"
                " VALUES (1, 'old', 'completed', 'tiny', 8, 1, 0, 25, '{}', '[]', '2026-01-01', 0, 0, 25, 0)"
            )
        )
        for step in range(1, 26):
            conn.execute(
                text(
                    "INSERT INTO steps (run_id, step, rollout_step, recorded_at, true_accuracy)"
                    " VALUES (1, :s, :s, '2026-01-01', :v)"
                ),
                {"s": step, "v": step / 100},
            )
            conn.execute(
                text("INSERT INTO metrics (run_id, step, name, value) VALUES (1, :s, 'x', :v)"),
                {"s": step, "v": float(step)},
            )
    upgrade(engine, "0004")  # 0005 replaces these rows by packed ones (test_compact_migration)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT name, bucket, n, total, lo, hi, first_step, last_step FROM series_rollups"
                " WHERE width = 10 ORDER BY name, bucket"
            )
        ).all()
    assert [tuple(r) for r in rows] == [
        ("true_accuracy", 0, 10, pytest.approx(0.55), 0.01, 0.1, 1, 10),
        ("true_accuracy", 1, 10, pytest.approx(1.55), 0.11, 0.2, 11, 20),
        ("true_accuracy", 2, 5, pytest.approx(1.15), 0.21, 0.25, 21, 25),
        ("x", 0, 10, 55.0, 1.0, 10.0, 1, 10),
        ("x", 1, 10, 155.0, 11.0, 20.0, 11, 20),
        ("x", 2, 5, 115.0, 21.0, 25.0, 21, 25),
    ]
    engine.dispose()


def test_migrations_carry_what_they_compute() -> None:
    """A migration imports no live code of ours: what it wrote must not change when the store,
    the layout or the alert rules do later (each carries a frozen copy of what it computes)."""
    import ast
    from pathlib import Path

    versions = Path(__file__).parents[2] / "migrations" / "versions"
    allowed = {"__future__", "collections", "dataclasses", "hashlib", "json", "math", "re"}
    allowed |= {"struct", "typing", "alembic", "sqlalchemy", "numpy", "zstandard"}
    scripts = sorted(versions.glob("*.py"))
    assert len(scripts) >= 8
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or ".").split(".")[0] if node.level == 0 else "."}
            else:
                continue
            assert roots <= allowed, f"{script.name} imports {roots - allowed}"


def test_upgrades_in_threads_of_one_process_each_reach_head(tmp_path) -> None:
    """Two RolloutLensCallbacks in one process migrate from their writers' threads at once:
    Alembic's one global context must not mix them up (it did: "table already exists",
    KeyError 'config')."""
    import threading

    errors: list[BaseException] = []
    engines = [make_engine(f"sqlite:///{tmp_path / f'db{i}.db'}") for i in range(6)]

    def migrate(engine) -> None:  # type: ignore[no-untyped-def]
        try:
            upgrade(engine)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors, errors
        assert [current_revision(e) for e in engines] == [head_revision()] * len(engines)
    finally:
        for engine in engines:
            engine.dispose()
