"""Number, money and time formats: the one definition the pages and the live JSON share (pure)."""

from __future__ import annotations

import math
from datetime import datetime


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


def fmt_when(value: str | datetime | None) -> str:
    """An ISO timestamp as 'YYYY-MM-DD HH:MM' UTC."""
    if value is None:
        return "—"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M UTC")
