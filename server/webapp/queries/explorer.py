"""The rollout explorer's reads: a run's rollouts across steps, filtered, searched and sorted,
a page at a time (keyset paging), with a bounded total count.

Filters and sorts read only the rollouts' scalar columns (and the search engines' indexes); the
per-token arrays are decoded for the rows of the page alone, for their completion heads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.store import arrays, search
from rollout_lens.server.store.models import PromptRow, RolloutRow
from rollout_lens.server.webapp.queries.keyset import (
    FilterQuery,
    check_scope,
    cursor_fields,
    encode_cursor,
    whole_number,
)
from rollout_lens.server.webapp.queries.mismatch_page import has_generator_side
from sqlalchemy import select, text
from sqlalchemy.orm import Session

MAX_PAGE = 200
WALK_FROM = 20_000  # past this many matches, a page walks the sort order instead of sorting them
MAX_ID = 2**31 - 1  # server.webapp.http.params.MAX_ID (params imports queries)
MAX_ROW_ID = 2**63 - 1  # a rollout's id (a 64-bit key on both databases)
COUNT_CAP = 100_000  # totals past this read "100,000+": counting millions of rows is not a page
HEAD_TOKENS = 96  # a row's completion head: its first tokens
HEAD_CHARS = 240

# sort key → SQL expression on the rollouts row `r`
SORTS: dict[str, str] = {
    "step": "r.step",
    "group": 'r."group"',
    "index": "r.idx",
    "reward": "r.verifier_reward",
    "true_score": "r.true_score",
    "advantage": "r.advantage",
    "abs_advantage": "abs(r.advantage)",
    "sum_logprob": "r.sum_logprob",
    "length": "r.n_tokens",
    "vote": "r.vote",
    "target": "r.target",
    "state": "r.format_state",
    # training–inference mismatch (0021): the largest |Δlogp| and the sequence ratio, sorted by
    # its log (the same order)
    "abs_diff_max": "r.abs_diff_max",
    "seq_ratio": "r.log_seq_ratio",
}
Sort = Literal[
    "step",
    "group",
    "index",
    "reward",
    "true_score",
    "advantage",
    "abs_advantage",
    "sum_logprob",
    "length",
    "vote",
    "target",
    "state",
    "abs_diff_max",
    "seq_ratio",
]
# Sort columns that can be NULL: NULLs sort first going up and last going down (SQLite's order,
# which its indexes keep; PostgreSQL is told so).
NULLABLE = frozenset(
    {"true_score", "sum_logprob", "length", "vote", "target", "state", "abs_diff_max", "seq_ratio"}
)
# What a cursor's value must be for each sort (checked before it reaches the database): the
# 32-bit integer columns, the float columns (±infinity allowed: Σ logprob keeps -inf) and text.
INT_SORTS = frozenset({"step", "group", "index", "length"})
TEXT_SORTS = frozenset({"vote", "target", "state"})
MAX_TEXT = 256  # the longest vote, target or state (records.LABEL_CHARS)
_STEPS = re.compile(r"^\s*(\d*)\s*:\s*(\d*)\s*$|^\s*(\d+)\s*$")
Number = Annotated[float | None, Field(ge=-1e300, le=1e300)]
Ratio = Annotated[float | None, Field(gt=0, le=1e300)]  # compared through its log


class RolloutQuery(FilterQuery):
    """What the explorer lists: every filter is optional and they all hold together."""

    steps: str | None = Field(
        default=None, max_length=50, description="a step or a range A:B (either end open)"
    )
    group: int | None = Field(default=None, ge=0, le=MAX_ID, description="one group of each step")
    state: str | None = Field(
        default=None, max_length=32, description="structural state (format_state)"
    )
    format_valid: bool | None = Field(default=None, description="format-valid or not")
    vote: str | None = Field(default=None, max_length=64, description="the tool id voted for")
    target: str | None = Field(default=None, max_length=64, description="the target id")
    reward_min: Number = Field(default=None, description="verifier reward at least")
    reward_max: Number = Field(default=None, description="verifier reward at most")
    true_min: Number = Field(default=None, description="true score at least")
    true_max: Number = Field(default=None, description="true score at most")
    adv_min: Number = Field(default=None, description="advantage at least")
    adv_max: Number = Field(default=None, description="advantage at most")
    len_min: int | None = Field(default=None, ge=0, le=MAX_ID, description="tokens at least")
    len_max: int | None = Field(default=None, ge=0, le=MAX_ID, description="tokens at most")
    diff_min: Number = Field(
        default=None, description="largest |Δlogp| (trainer vs generator) of a token at least"
    )
    diff_max: Number = Field(
        default=None, description="largest |Δlogp| (trainer vs generator) of a token at most"
    )
    ratio_min: Ratio = Field(
        default=None, description="sequence ratio p_trainer / p_generator at least (> 0)"
    )
    ratio_max: Ratio = Field(
        default=None, description="sequence ratio p_trainer / p_generator at most (> 0)"
    )
    disagree: bool = Field(
        default=False, description="only where verifier reward and true score disagree"
    )
    alert: bool = Field(default=False, description="only steps where an alert fired")
    q: str | None = Field(
        default=None,
        max_length=search.MAX_QUERY_CHARS,
        description="words that must all appear in completion or prompt",
    )
    sort: Sort = Field(default="step", description="the column to sort by")
    order: Literal["asc", "desc"] = "asc"
    after: str | None = Field(
        default=None, max_length=4096, description="the `next` cursor of a page"
    )
    limit: int = Field(
        default=50, ge=1, le=MAX_PAGE, description=f"rows a page (at most {MAX_PAGE})"
    )

    @field_validator("steps")
    @classmethod
    def _steps(cls, value: str | None) -> str | None:
        found = _STEPS.match(value) if value is not None and value.strip() else None
        if value is not None and value.strip() and not found:
            raise ValueError("steps is a step (12) or a range A:B, e.g. 100:200, :50 or 900:")
        if found and any(len(g) > 10 or int(g) > MAX_ID for g in found.groups() if g):
            raise ValueError(f"steps go from 0 to {MAX_ID:,}")
        return value.strip() if value and value.strip() else None

    @field_validator("state", "vote", "target", "q")
    @classmethod
    def _blank_is_none(cls, value: str | None) -> str | None:
        if value is not None and not storable_text(value):
            raise ValueError("holds a character no database stores (NUL or a lone surrogate)")
        return value if value and value.strip() else None

    def step_range(self) -> tuple[int | None, int | None]:
        """The inclusive step range `steps` names (None: open)."""
        if self.steps is None:
            return None, None
        found = _STEPS.match(self.steps)
        assert found is not None  # validated
        if found.group(3) is not None:
            one = int(found.group(3))
            return one, one
        lo, hi = found.group(1), found.group(2)
        return (int(lo) if lo else None), (int(hi) if hi else None)


def storable_text(value: str) -> bool:
    """Whether a text can reach either database as it is (no NUL, no unpaired surrogate)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NOT_OURS = "after: not a cursor this explorer gave out"


@dataclass(frozen=True)
class _Cursor:
    """Where a page ended: the run and query it belongs to (a fingerprint), the sort, and the
    last row's sort value and id. Checked whole when it comes back: another run's or another
    query's cursor would skip rows silently, a forged value would reach the database."""

    run_id: int
    digest: str
    sort: str
    order: str
    is_null: bool
    value: Any
    id: int

    def encode(self) -> str:
        fields = [self.run_id, self.digest, self.sort, self.order, self.is_null, self.value]
        return encode_cursor([*fields, self.id], allow_nan=True)

    @classmethod
    def decode(cls, cursor: str, *, run_id: int, query: RolloutQuery) -> _Cursor:
        try:
            run, digest, sort, order, is_null, value, row_id = cursor_fields(cursor, _NOT_OURS)
        except (ValueError, TypeError) as exc:  # not 7 fields
            raise InvalidInput(_NOT_OURS) from exc
        if not (whole_number(run, 1, MAX_ID) and whole_number(row_id, 1, MAX_ROW_ID)):
            raise InvalidInput(_NOT_OURS)
        if not all(isinstance(v, str) for v in (digest, sort, order)) or not isinstance(
            is_null, bool
        ):
            raise InvalidInput(_NOT_OURS)
        check_scope(
            query,
            what="rollouts",
            run=run,
            run_id=run_id,
            sorted_by=(sort, order),
            asked=(query.sort, query.order),
            digest=digest,
        )
        return cls(run, digest, sort, order, is_null, _sort_value(sort, is_null, value), row_id)


def _sort_value(sort: str, is_null: bool, value: Any) -> Any:
    """A cursor's sort value, checked against the column it is compared with."""
    if is_null:
        if value is not None or sort not in NULLABLE:
            raise InvalidInput(_NOT_OURS)
        return None
    if sort in INT_SORTS:
        if not whole_number(value, -MAX_ID - 1, MAX_ID):
            raise InvalidInput(f"after: the cursor's {sort} is not a whole number in range")
        return value
    if sort in TEXT_SORTS:
        if not isinstance(value, str) or len(value) > MAX_TEXT or not storable_text(value):
            raise InvalidInput(f"after: the cursor's {sort} is not a text this explorer sorts")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"after: the cursor's {sort} is not a number")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidInput(f"after: the cursor's {sort} is out of range") from None
    if math.isnan(number):
        raise InvalidInput(f"after: the cursor's {sort} is not a number")
    return number


# The range filters: (column, the query's field, its comparison); a ratio is compared through
# its log (rollouts.log_seq_ratio).
RANGES = tuple(
    (column, f"{prefix}_{end}", ">=" if end == "min" else "<=")
    for column, prefix in (
        ("r.verifier_reward", "reward"),
        ("r.true_score", "true"),
        ("r.advantage", "adv"),
        ("r.n_tokens", "len"),
        ("r.abs_diff_max", "diff"),
        ("r.log_seq_ratio", "ratio"),
    )
    for end in ("min", "max")
)
Searched = search.Match | None  # search.match_sql's condition for `q`, if any


def _searched(session: Session, run_id: int, query: RolloutQuery) -> Searched:
    if query.q is None:
        return None
    return search.match_sql(session.connection(), run_id=run_id, q=query.q)


def _where(
    session: Session,
    run_id: int,
    query: RolloutQuery,
    searched: Searched,
    *,
    walk: bool = False,
) -> tuple[list[str], dict[str, Any]]:
    """The filters as SQL on rollouts `r`, `q`'s as `searched` found it (once: finding it reads
    the search index). With `walk`, SQLite is kept from answering the filters through their
    indexes (a unary + on the column), so that it walks the sort order's index and stops at the
    page's end: right when most rows match, as the count just said."""
    clauses, params = ["r.run_id = :run"], {"run": run_id}
    hint = "+" if walk and session.get_bind().dialect.name == "sqlite" else ""

    def add(clause: str, **values: Any) -> None:
        clauses.append(clause)
        params.update(values)

    lo, hi = query.step_range()
    if lo is not None:
        add("r.step >= :step_lo", step_lo=lo)
    if hi is not None:
        add("r.step <= :step_hi", step_hi=hi)
    if query.group is not None:
        add('r."group" = :group', group=query.group)
    if query.state is not None:
        add(f"{hint}r.format_state = :state", state=query.state)
    if query.format_valid is not None:
        add(f"{hint}r.format_valid = :format_valid", format_valid=query.format_valid)
    if query.vote is not None:
        add(f"{hint}r.vote = :vote", vote=query.vote)
    if query.target is not None:
        add(f"{hint}r.target = :target", target=query.target)
    for column, name, op in RANGES:
        value = getattr(query, name)
        if value is not None:
            value = math.log(value) if name.startswith("ratio_") else value
            add(f"{hint}{column} {op} :{name}", **{name: value})
    if query.disagree:
        add(f"{hint}r.disagree = :disagree", disagree=True)
    if query.alert:
        add(
            "r.step IN (SELECT s.rollout_step FROM steps s JOIN alerts a "
            "ON a.run_id = s.run_id AND a.step = s.step WHERE s.run_id = :run)"
        )
    if searched is not None:
        add(searched.sql, **searched.params)
    return clauses, params


def _after(query: RolloutQuery, cursor: _Cursor, params: dict[str, Any]) -> str:
    """Rows past `cursor` in (value, id) order, NULLs first going up and last going down."""
    column = SORTS[query.sort]
    op = ">" if query.order == "asc" else "<"
    params["cursor_id"] = cursor.id
    if cursor.is_null:
        tail = f"({column} IS NULL AND r.id {op} :cursor_id)"
        return f"({tail} OR {column} IS NOT NULL)" if query.order == "asc" else tail
    params["cursor_value"] = cursor.value
    past = f"({column} {op} :cursor_value OR ({column} = :cursor_value AND r.id {op} :cursor_id))"
    if query.sort in NULLABLE and query.order == "desc":
        return f"({past} OR {column} IS NULL)"
    return past


def _order_by(session: Session, query: RolloutQuery) -> str:
    column, direction = SORTS[query.sort], query.order.upper()
    nulls = ""
    if query.sort in NULLABLE and session.get_bind().dialect.name == "postgresql":
        nulls = " NULLS FIRST" if query.order == "asc" else " NULLS LAST"
    return f"{column} {direction}{nulls}, r.id {direction}"


def explore(
    session: Session, *, run_id: int, query: RolloutQuery, count_cap: int = COUNT_CAP
) -> dict[str, Any]:
    """One page of a run's rollouts that match `query`: rows, a total counted up to
    `count_cap`, and the cursor of the next page (None on the last)."""
    run = store.get_run(session, run_id=run_id)
    cursor_at = None  # checked before any other statement
    if query.after is not None:
        cursor_at = _Cursor.decode(query.after, run_id=run_id, query=query)
    searched = _searched(session, run_id, query)
    clauses, params = _where(session, run_id, query, searched)
    if searched is not None and searched.total is not None and clauses[1:] == [searched.sql]:
        counted = searched.total  # no filter but q's, whose matches the index counted
    else:
        where = " AND ".join(clauses)
        counted = session.execute(
            text(f"SELECT count(*) FROM (SELECT 1 FROM rollouts r WHERE {where} LIMIT :cap) AS m"),
            params | {"cap": count_cap + 1},
        ).scalar_one()
    if counted > WALK_FROM and query.sort not in NULLABLE:
        clauses, params = _where(session, run_id, query, searched, walk=True)
    if cursor_at is not None:
        clauses.append(_after(query, cursor_at, params))
    rows = session.execute(
        text(
            f"SELECT r.id, {SORTS[query.sort]} AS sort_value FROM rollouts r "
            f"WHERE {' AND '.join(clauses)} ORDER BY {_order_by(session, query)} LIMIT :limit"
        ),
        params | {"limit": query.limit + 1},
    ).all()
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    cursor = None
    if more:
        last = rows[-1]
        cursor = _Cursor(
            run_id, query.digest(), query.sort, query.order, last[1] is None, last[1], last[0]
        ).encode()
    return {
        "run": {"id": run.id, "name": run.name, "control_tokens": list(run.control_tokens)},
        "generator_side": has_generator_side(session, run_id=run_id),
        "rollouts": _rows(session, run_id, [r[0] for r in rows]),
        "total": min(counted, count_cap),
        "total_capped": counted > count_cap,
        "next": cursor,
        "filters": query.filters(),
    }


def _rows(session: Session, run_id: int, ids: list[int]) -> list[dict[str, Any]]:
    """The page's rollouts as rows, in `ids` order, with prompt and completion heads."""
    if not ids:
        return []
    found = {
        r.id: (r, prompt)
        for r, prompt in session.execute(
            select(RolloutRow, PromptRow.text)
            .join(PromptRow, PromptRow.id == RolloutRow.prompt_id)
            .where(RolloutRow.id.in_(ids))
        )
    }
    heads = {
        rid: arrays.decode_ids(r.data.ids)[:HEAD_TOKENS].tolist() if r.data is not None else []
        for rid, (r, _) in found.items()
    }
    texts = store.token_texts(session, run_id=run_id, ids={i for h in heads.values() for i in h})
    out = []
    for rid in ids:
        r, prompt = found[rid]
        out.append(
            {
                "id": r.id,
                "step": r.step,
                "group": r.group,
                "index": r.index,
                "vote": r.vote,
                "target": r.target,
                "verifier_reward": r.verifier_reward,
                "true_score": r.true_score,
                "advantage": r.advantage,
                "sum_logprob": r.sum_logprob,
                "format_valid": r.format_valid,
                "format_state": r.format_state,
                "length": r.n_tokens,
                "disagree": r.disagree,
                "abs_diff_max": r.abs_diff_max,
                "log_seq_ratio": r.log_seq_ratio,
                "prompt_head": _head(prompt),
                "completion_head": completion_head(r, heads[rid], texts),
            }
        )
    return out


def _head(value: str) -> str:
    return value if len(value) <= HEAD_CHARS else value[:HEAD_CHARS] + "…"


def completion_head(r: RolloutRow, head_ids: list[int], texts: dict[int, str]) -> str:
    """A row's completion head as the step viewer shows its text: its first tokens, cut."""
    if r.text_rule is not None and all(i in texts for i in head_ids):
        pieces = [texts[i] for i in head_ids]
        cut = r.n_tokens is not None and r.n_tokens > len(head_ids)
        dropped = r.text_rule // 8  # closing tokens the text leaves out (arrays.text_rule)
        if not cut and dropped:  # the head is the whole completion: end it as its text ends
            pieces = pieces[: len(pieces) - dropped]
        head = arrays.preview(r.text_rule, pieces)
        return _head(head + ("…" if cut else ""))
    stored = r.data.text if r.data is not None else None
    return _head(arrays.text_head(stored, HEAD_CHARS + 1)) if stored is not None else ""
