"""What the explorer's and the prompt lens's keyset pages share: the query model's filters and
their fingerprint (what a cursor belongs to), cursors as URL-safe base64 of their JSON fields, and
the checks a cursor that comes back must pass before anything of it reaches the database."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from rollout_lens.server.core.errors import InvalidInput


class FilterQuery(BaseModel):
    """A paged list's query: filters and a sort, plus the fields of paging (PAGING), which
    neither the links that keep the filters nor a cursor's fingerprint hold."""

    model_config = ConfigDict(extra="forbid")
    PAGING: ClassVar[set[str]] = {"after", "limit"}

    @model_validator(mode="before")
    @classmethod
    def _blank_fields_are_unset(cls, data: Any) -> Any:
        """The filter form sends every field; an empty one is no filter."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and not v.strip())}
        return data

    def filters(self) -> dict[str, Any]:
        """The filters given (for links that keep them), without paging."""
        return self.model_dump(exclude_defaults=True, exclude=self.PAGING)

    def digest(self) -> str:
        """A short fingerprint of the filters and sort (what a cursor belongs to; not paging)."""
        filters = self.model_dump(exclude=self.PAGING)
        canonical = json.dumps(filters, sort_keys=True, ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def encode_cursor(fields: list[Any], *, allow_nan: bool = False) -> str:
    """A cursor: its fields as URL-safe base64 of their JSON."""
    raw = json.dumps(fields, allow_nan=allow_nan)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def cursor_fields(cursor: str, not_ours: str) -> Any:
    """A cursor's JSON, decoded (InvalidInput(not_ours) for any text that is not one)."""
    try:
        return json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidInput(not_ours) from exc


def whole_number(value: Any, lo: int, hi: int) -> bool:
    """Whether a cursor's field is a whole number (not a bool or a float) from lo to hi."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def check_scope(
    query: FilterQuery,
    *,
    what: str,
    run: Any,
    run_id: int,
    sorted_by: tuple[Any, Any],
    asked: tuple[str, str],
    digest: Any,
) -> None:
    """A cursor's run, (sort, order) and fingerprint against the request's run, `asked` (its
    sort and order) and query: another run's or another query's cursor would skip rows
    silently."""
    if run != run_id:
        raise InvalidInput(
            f"after: the cursor is for run {run}'s {what}, not run {run_id}'s; start from the "
            "first page"
        )
    if sorted_by != asked:
        raise InvalidInput("after: the cursor is for another sort; start from the first page")
    if digest != query.digest():
        raise InvalidInput(
            "after: the cursor is for other filters or another search; start from the first page"
        )
