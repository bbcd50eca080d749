"""Parsing of list-valued query parameters shared by pages and the API."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_lens.server.errors import InvalidInput


def split_list(values: Iterable[str] | None) -> list[str]:
    """`a,b` and repeated parameters alike → [a, b] (blank items dropped)."""
    return [item.strip() for value in values or () for item in value.split(",") if item.strip()]


def run_ids(values: Iterable[str] | None) -> list[int]:
    """Run ids from `runs=1,2` or `runs=1&runs=2`."""
    items = split_list(values)
    try:
        return [int(item) for item in items]
    except ValueError:
        raise InvalidInput(f"run ids must be whole numbers, got {', '.join(items)}") from None
