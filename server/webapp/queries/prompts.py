"""The prompt lens's reads: a run's prompts with what happened to each (filtered, searched,
sorted, a page at a time by keyset as the explorer pages), and the prompts a filter selects as a
dataset; the query and cursor rules the heatmap (queries.prompt_groups) pages by too.

Every read is of the per-prompt rollups the writer keeps (server.store.prompt_rollups): a row a
run's prompt (`run_prompts`) and a row a group (`prompt_groups`); queries.prompt_groups reads the
groups (the heatmap, a prompt's history), queries.prompt_compare the same prompts across runs.
server.core.prompt_rules says what each figure means.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.prompt_rules import (
    FLIPPING_FLIPS,
    STUCK_SHARE,
    chat_messages,
    votes_object,
)
from rollout_lens.server.store import prompt_texts as stored_texts
from rollout_lens.server.store import search
from rollout_lens.server.store.prompt_rollups import stored_votes
from rollout_lens.server.webapp.queries.explorer import MAX_ID, storable_text
from rollout_lens.server.webapp.queries.keyset import (
    FilterQuery,
    check_scope,
    cursor_fields,
    encode_cursor,
    whole_number,
)
from sqlalchemy import text
from sqlalchemy.orm import Session

MAX_PAGE = 500  # prompts a page (the heatmap's rows too)
TOP_VOTES = 5  # votes a prompts-list row shows, most first
LABEL_HEAD = 240  # characters of a prompt's distinguishing text in a list
PREFIX_READ = 4_000  # characters of each prompt read to find the prefix a run's prompts share
HEATMAP_COLUMNS = 200  # the heatmap's default width in columns (steps, or buckets of steps)
MAX_COLUMNS = 2_000
MAX_HISTORY = 5_000  # groups a history page holds at most
HISTORY_PAGE = 1_000
MAX_COMPARE_RUNS = 4
EXPORT_PAGE = 1_000  # prompts read a statement while exporting

# sort key → SQL expression on the run_prompts row `p`
SORTS: dict[str, str] = {
    "prompt": "p.prompt_id",
    "label": "p.label",
    "groups": "p.groups",
    "first_step": "p.first_step",
    "last_step": "p.last_step",
    "reward_mean": "(p.reward_sum / NULLIF(p.reward_n, 0))",
    "true_mean": "(p.true_sum / NULLIF(p.true_n, 0))",
    "solved_at": "p.solved_at",
    "last_failed": "p.last_failed",
    "flips": "p.flips",
    "zero_spread_share": "(CAST(p.zero_spread AS FLOAT) / p.groups)",
}
Sort = Literal[
    "prompt",
    "label",
    "groups",
    "first_step",
    "last_step",
    "reward_mean",
    "true_mean",
    "solved_at",
    "last_failed",
    "flips",
    "zero_spread_share",
]
NULLABLE = frozenset({"reward_mean", "true_mean", "solved_at", "last_failed"})
INT_SORTS = frozenset(
    {"prompt", "groups", "first_step", "last_step", "solved_at", "last_failed", "flips"}
)
TEXT_SORTS = frozenset({"label"})
# look → (its words on the page, SQL on `p`)
LOOKS: dict[str, tuple[str, str]] = {
    "never_solved": ("never solved", "(p.solved_at IS NULL AND p.last_failed IS NOT NULL)"),
    "solved": ("solved at least once", "(p.solved_at IS NOT NULL)"),
    "flipping": (f"flipping ({FLIPPING_FLIPS}+ flips)", f"(p.flips >= {FLIPPING_FLIPS})"),
    "stuck": (
        f"stuck: no gradient in {STUCK_SHARE:.0%}+ of its groups, never solved",
        f"(p.solved_at IS NULL AND p.zero_spread >= {STUCK_SHARE} * p.groups)",
    ),
    "forgotten": ("forgotten: solved, then failed", "(p.last_failed > p.solved_at)"),
}
Look = Literal["never_solved", "solved", "flipping", "stuck", "forgotten"]
Match = Literal["query", "user", "exact"]
MATCH_KEYS: dict[str, str] = {"query": "query_key", "user": "user_key", "exact": "prompt_id"}

PROMPT_COLUMNS = (
    "p.prompt_id, p.label, p.groups, p.rollouts, p.first_step, p.last_step, p.reward_sum, "
    "p.reward_n, p.true_sum, p.true_n, p.solved_groups, p.solved_at, p.last_solved, "
    "p.last_failed, p.state, p.flips, p.zero_spread, p.votes, p.target, p.query_key, p.user_key"
)


class PromptQuery(FilterQuery):
    """What the prompts list (and the heatmap's rows) shows: every filter optional."""

    PAGING: ClassVar[set[str]] = {"after", "limit", "width"}  # width: HeatmapQuery's

    look: Look | None = Field(
        default=None,
        description="never_solved, solved, flipping, stuck (no gradient), forgotten",
    )
    q: str | None = Field(
        default=None,
        max_length=search.MAX_QUERY_CHARS,
        description="words that must all appear in the prompt (the explorer's search)",
    )
    sort: Sort = Field(default="first_step", description="the figure to sort by")
    order: Literal["asc", "desc"] = "asc"
    after: str | None = Field(
        default=None, max_length=4096, description="the `next` cursor of a page"
    )
    limit: int = Field(
        default=50, ge=1, le=MAX_PAGE, description=f"prompts a page (at most {MAX_PAGE})"
    )

    @field_validator("q")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        if value is not None and not storable_text(value):
            raise ValueError("holds a character no database stores (NUL or a lone surrogate)")
        return value if value and value.strip() else None


class HeatmapQuery(PromptQuery):
    """The heatmap's rows (a PromptQuery: its cursors are the list's) and its width."""

    width: int = Field(
        default=HEATMAP_COLUMNS,
        ge=1,
        le=MAX_COLUMNS,
        description="columns at most: more steps than this are bucketed",
    )


# --- cursors -------------------------------------------------------------------------------------

_NOT_OURS = "after: not a cursor this list gave out"


def decode_cursor(cursor: str, kind: str, size: int) -> list[Any]:
    """The `size` fields of a cursor of `kind` (its first field; InvalidInput for any other
    text)."""
    fields = cursor_fields(cursor, _NOT_OURS)
    if not isinstance(fields, list) or len(fields) != size or fields[0] != kind:
        raise InvalidInput(_NOT_OURS)
    return fields


def _cursor_at(cursor: str, *, run_id: int, query: PromptQuery) -> tuple[Any, int]:
    """(sort value or None, prompt id) a page's cursor ended at, checked whole."""
    _, run, digest, sort, order, value, prompt_id = decode_cursor(cursor, "prompts", 7)
    if not (whole_number(run, 1, MAX_ID) and whole_number(prompt_id, 1, 2**63 - 1)):
        raise InvalidInput(_NOT_OURS)
    check_scope(
        query,
        what="prompts",
        run=run,
        run_id=run_id,
        sorted_by=(sort, order),
        asked=(query.sort, query.order),
        digest=digest,
    )
    if value is None:
        if query.sort not in NULLABLE:
            raise InvalidInput(_NOT_OURS)
    elif query.sort in INT_SORTS:
        if not whole_number(value, -MAX_ID - 1, MAX_ID):
            raise InvalidInput(f"after: the cursor's {query.sort} is not a whole number in range")
    elif query.sort in TEXT_SORTS:
        if not isinstance(value, str) or len(value) > 10_000 or not storable_text(value):
            raise InvalidInput(f"after: the cursor's {query.sort} is not a text")
    elif (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(float(value))
    ):
        raise InvalidInput(f"after: the cursor's {query.sort} is not a number")
    return value, prompt_id


# --- the prompts list ------------------------------------------------------------------------


def run_head(session: Session, run_id: int) -> dict[str, Any]:
    """The run's id, name and status (NotFound when there is none)."""
    run = store.get_run(session, run_id=run_id)
    return {"id": run.id, "name": run.name, "status": run.status}


def _where(session: Session, run_id: int, query: PromptQuery) -> tuple[list[str], dict[str, Any]]:
    clauses, params = ["p.run_id = :run"], {"run": run_id}
    if query.look is not None:
        clauses.append(LOOKS[query.look][1])
    if query.q is not None:
        found = search.prompt_match_sql(session.connection(), q=query.q, column="p.prompt_id")
        clauses.append(found.sql)
        params.update(found.params)
    return clauses, params


def _after(query: PromptQuery, value: Any, prompt_id: int, params: dict[str, Any]) -> str:
    """Rows past the cursor in (value, prompt id) order, NULLs first going up, last going down
    (the explorer's rule)."""
    column = SORTS[query.sort]
    op = ">" if query.order == "asc" else "<"
    params["cursor_id"] = prompt_id
    if value is None:
        tail = f"({column} IS NULL AND p.prompt_id {op} :cursor_id)"
        return f"({tail} OR {column} IS NOT NULL)" if query.order == "asc" else tail
    params["cursor_value"] = value
    past = (
        f"({column} {op} :cursor_value OR ({column} = :cursor_value AND p.prompt_id {op} "
        ":cursor_id))"
    )
    if query.sort in NULLABLE and query.order == "desc":
        return f"({past} OR {column} IS NULL)"
    return past


def _order_by(session: Session, query: PromptQuery) -> str:
    column, direction = SORTS[query.sort], query.order.upper()
    nulls = ""
    if query.sort in NULLABLE and session.get_bind().dialect.name == "postgresql":
        nulls = " NULLS FIRST" if query.order == "asc" else " NULLS LAST"
    return f"{column} {direction}{nulls}, p.prompt_id {direction}"


def list_page(
    session: Session, run_id: int, query: PromptQuery
) -> tuple[list[Any], int, str | None]:
    """The rows of one page (run_prompts columns `PROMPT_COLUMNS` and the sort value), the total
    that match, and the next page's cursor."""
    at = _cursor_at(query.after, run_id=run_id, query=query) if query.after else None
    clauses, params = _where(session, run_id, query)
    total = session.execute(
        text(f"SELECT count(*) FROM run_prompts p WHERE {' AND '.join(clauses)}"), params
    ).scalar_one()
    if at is not None:
        clauses.append(_after(query, at[0], at[1], params))
    rows = session.execute(
        text(
            f"SELECT {PROMPT_COLUMNS}, {SORTS[query.sort]} AS sort_value FROM run_prompts p "
            f"WHERE {' AND '.join(clauses)} ORDER BY {_order_by(session, query)} LIMIT :limit"
        ),
        params | {"limit": query.limit + 1},
    ).all()
    cursor = None
    if len(rows) > query.limit:
        rows = rows[: query.limit]
        last = rows[-1]
        value = last.sort_value
        if value is not None and query.sort not in INT_SORTS | TEXT_SORTS:
            value = float(value)
        cursor = encode_cursor(
            ["prompts", run_id, query.digest(), query.sort, query.order, value, last.prompt_id]
        )
    return list(rows), int(total), cursor


def prompt_figures(row: Any) -> dict[str, Any]:
    """A run_prompts row's figures, as the API names them."""
    votes = stored_votes(row.votes)
    return {
        "prompt_id": row.prompt_id,
        "label": row.label,
        "groups": row.groups,
        "rollouts": row.rollouts,
        "first_step": row.first_step,
        "last_step": row.last_step,
        "reward_mean": row.reward_sum / row.reward_n if row.reward_n else None,
        "true_mean": row.true_sum / row.true_n if row.true_n else None,
        "solved_groups": row.solved_groups,
        "solved_at": row.solved_at,
        "last_solved": row.last_solved,
        "last_failed": row.last_failed,
        "state": None if row.state is None else ("solved" if row.state else "failed"),
        "flips": row.flips,
        "zero_spread_share": row.zero_spread / row.groups if row.groups else None,
        "forgotten": (
            row.solved_at is not None
            and row.last_failed is not None
            and row.last_failed > row.solved_at
        ),
        "votes": votes_object(votes[:TOP_VOTES]),
        "target": row.target,
    }


def prompt_texts(session: Session, prompt_ids: Sequence[int]) -> dict[int, str]:
    """Prompt id → its whole text."""
    return stored_texts.texts(session, prompt_ids)


def shared_prefix(session: Session, *, run_id: int) -> int:
    """Characters every prompt of the run starts with, read back to the start of the line
    where they part: the lexically first and last prompts' common prefix is every prompt's."""
    ids = session.execute(
        text("SELECT prompt_id FROM run_prompts WHERE run_id = :run"), {"run": run_id}
    ).scalars()
    heads = [t[:PREFIX_READ] for t in stored_texts.texts(session, ids).values()]
    if len(heads) < 2:
        return 0
    first, last = min(heads), max(heads)
    common = len(os.path.commonprefix([first, last]))
    return int(first.rfind("\n", 0, common)) + 1


def distinguishing_labels(
    session: Session, run_id: int, rows: Sequence[Any], texts: dict[int, str]
) -> dict[int, str]:
    """Each row's distinguishing text: its stored label (the query it names, or its last user
    turn), or, where that is the whole prompt (no chat template, no query), what follows the
    prefix all the run's prompts share; LABEL_HEAD characters of it."""
    out: dict[int, str] = {}
    prefix: int | None = None
    for row in rows:
        label = row.label
        whole = texts.get(row.prompt_id)
        if whole is not None and whole.startswith(label):
            if prefix is None:
                prefix = shared_prefix(session, run_id=run_id)
            label = ("…" if prefix else "") + whole[prefix:] if prefix < len(whole) else whole
        label = label.strip()
        out[row.prompt_id] = label if len(label) <= LABEL_HEAD else label[:LABEL_HEAD] + "…"
    return out


def prompts_page(session: Session, *, run_id: int, query: PromptQuery) -> dict[str, Any]:
    """One page of a run's prompts that match `query`, with their figures and whole text; the
    total that match and the next page's cursor (None on the last)."""
    run = run_head(session, run_id)
    rows, total, cursor = list_page(session, run_id, query)
    texts = prompt_texts(session, [r.prompt_id for r in rows])
    labels = distinguishing_labels(session, run_id, rows, texts)
    prompts = [
        prompt_figures(r) | {"label": labels[r.prompt_id], "text": texts.get(r.prompt_id, "")}
        for r in rows
    ]
    return {
        "run": run,
        "prompts": prompts,
        "total": total,
        "next": cursor,
        "filters": query.filters(),
    }


# --- a dataset out ---------------------------------------------------------------------------


def export_prompts(
    session: Session, *, run_id: int, query: PromptQuery
) -> Iterator[dict[str, Any]]:
    """Every prompt `query` selects (its filters and sort; no paging), as a TRL dataset's row:
    `prompt` its chat messages, `target` where its rollouts named one, and its figures."""
    store.get_run(session, run_id=run_id)
    page = query.model_copy(update={"limit": min(EXPORT_PAGE, MAX_PAGE), "after": None})
    while True:
        rows, _, cursor = list_page(session, run_id, page)
        texts = prompt_texts(session, [r.prompt_id for r in rows])
        for r in rows:
            whole = texts.get(r.prompt_id, "")
            figures = prompt_figures(r)
            yield {
                "prompt": chat_messages(whole),
                "target": r.target,
                "prompt_id": r.prompt_id,
                "run_id": run_id,
                **{k: figures[k] for k in ("label", "groups", "true_mean", "solved_at", "flips")},
            }
        if cursor is None:
            return
        page = page.model_copy(update={"after": cursor})
