"""Number, money and time formats: the one definition the pages and the live JSON share (pure)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any


def fmt_num(value: float | int | None, digits: int = 3) -> str:
    """A number for a table cell: fixed decimals for floats, '—' for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, bool | int):
        return str(int(value))
    if value != 0 and abs(value) < 10 ** (-digits):
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}f}"


def fmt_pct(value: float | None) -> str:
    """0.875 → '87.5%'."""
    return "—" if value is None else f"{value * 100:.1f}%"


def fmt_money(value: float | None) -> str:
    """Dollars with cents."""
    return "—" if value is None else f"${value:,.2f}"


def fmt_minutes(value: float | None) -> str:
    """Device-minutes with one decimal."""
    return "—" if value is None else f"{value:,.1f}"


def iso(value: datetime | None) -> str | None:
    """A stored time as ISO 8601 in UTC with its zone (SQLite hands back naive UTC, PostgreSQL
    aware)."""
    if value is None:
        return None
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return aware.isoformat()


def fmt_when(value: str | datetime | None) -> str:
    """An ISO timestamp as 'YYYY-MM-DD HH:MM' UTC."""
    if value is None:
        return "—"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M UTC")


# How each live field of a run reads on a page: the templates' filters, applied by the server to
# the JSON live pages poll, so a page's script sets text and never formats a number itself.
LIVE_FORMATS: dict[str, Callable[[Any], str]] = {
    "current_step": str,
    "recent_true_accuracy": fmt_num,
    "recent_reward": fmt_num,
    "device_minutes": fmt_minutes,
    "cost": fmt_money,
    "finished_at": fmt_when,
    "ended_by": lambda who: who or "—",
    "queue_position": lambda place: f"#{place} in queue" if place else "",
    "phase": lambda phase: phase or "",
}


def live_text(run: Mapping[str, Any]) -> dict[str, str]:
    """The text of each live field the run dict has (data-field → text), for `run["text"]`."""
    return {field: fmt(run[field]) for field, fmt in LIVE_FORMATS.items() if field in run}
