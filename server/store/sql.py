"""Small SQL helpers the store modules share (dialect differences live here)."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, func
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session


def _dialect_name(bind: Session | Connection) -> str:
    """'sqlite' or 'postgresql'."""
    engine = bind.get_bind() if isinstance(bind, Session) else bind
    return engine.dialect.name


def upsert_insert(bind: Session | Connection, table: Any) -> Any:
    """A dialect insert that supports ON CONFLICT (SQLite and PostgreSQL)."""
    return pg_insert(table) if _dialect_name(bind) == "postgresql" else sqlite_insert(table)


def greatest(bind: Session | Connection) -> Any:
    """Two-argument max: SQLite's scalar max(), PostgreSQL's greatest()."""
    return func.max if _dialect_name(bind) == "sqlite" else func.greatest


def finite(value: float | None) -> float | None:
    """NaN and infinities are stored as NULL: neither JSON nor a chart can show them."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
