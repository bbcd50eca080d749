"""Helpers for tests that look at the SQL the store sends: every statement an engine runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event


@contextmanager
def executed(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """The (statement, parameters) of each statement `engine` runs inside the block, as the
    driver gets them (so `exec_driver_sql` can run one again, under EXPLAIN say)."""
    seen: list[tuple[str, Any]] = []

    def grab(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", grab)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", grab)
