"""The prompt lens across runs: the runs' prompts matched by their query, their last user turn
or their exact text, each run's figures side by side."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.store import search
from rollout_lens.server.webapp.queries.keyset import encode_cursor
from rollout_lens.server.webapp.queries.prompts import (
    LABEL_HEAD,
    MATCH_KEYS,
    MAX_COMPARE_RUNS,
    MAX_PAGE,
    PROMPT_COLUMNS,
    Match,
    decode_cursor,
    prompt_figures,
    run_head,
)
from sqlalchemy import text
from sqlalchemy.orm import Session


def compare_prompts(
    session: Session,
    *,
    run_ids: Sequence[int],
    match: Match = "query",
    q: str | None = None,
    every: bool = True,
    after: str | None = None,
    limit: int = 50,
) -> dict[str, Any]:
    """The runs' prompts matched across them (`match`: `query`, the query a prompt's env named,
    else its last user turn; `user`, its last user turn; `exact`, the same text), sorted by
    label, a page of `limit` matches; `every`: only prompts that every run has. Each match
    lists each run's prompts under it with their figures."""
    if not 2 <= len(run_ids) <= MAX_COMPARE_RUNS or len(set(run_ids)) != len(run_ids):
        raise InvalidInput(f"runs: from 2 to {MAX_COMPARE_RUNS} different runs, e.g. runs=1,2")
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit: from 1 to {MAX_PAGE}")
    if match not in MATCH_KEYS:
        raise InvalidInput("match: one of query, user, exact")
    runs = [run_head(session, run_id) for run_id in run_ids]
    by_key = _by_key(session, run_ids, MATCH_KEYS[match], q)
    matched = [
        (min(r.label for rows in per_run for r in rows), key, per_run)
        for key, per_run in by_key.items()
        if not every or all(per_run)
    ]
    matched.sort(key=lambda m: (m[0], m[1]))
    digest = hashlib.sha256(json.dumps([list(run_ids), match, q, every]).encode()).hexdigest()[:16]
    if after is not None:
        matched = _after(matched, after, digest)
    total = len(matched)
    page, more = matched[:limit], len(matched) > limit
    cursor = encode_cursor(["compare", digest, page[-1][0], page[-1][1]]) if more else None
    return {
        "runs": runs,
        "match": match,
        "prompts": [
            {
                "key": key,
                "label": label[:LABEL_HEAD],
                "runs": [
                    {"run_id": run_id, "prompts": [prompt_figures(r) for r in rows]}
                    for run_id, rows in zip(run_ids, per_run, strict=True)
                ],
            }
            for label, key, per_run in page
        ],
        "total": total,
        "next": cursor,
    }


def _by_key(
    session: Session, run_ids: Sequence[int], key_column: str, q: str | None
) -> dict[str, list[list[Any]]]:
    """Each run's prompts (those `q` finds, if given) under their match key, a list a run."""
    by_key: dict[str, list[list[Any]]] = {}
    for i, run_id in enumerate(run_ids):
        clauses, params = ["p.run_id = :run"], {"run": run_id}
        if q is not None and q.strip():
            found = search.prompt_match_sql(session.connection(), q=q, column="p.prompt_id")
            clauses.append(found.sql)
            params.update(found.params)
        for row in session.execute(
            text(f"SELECT {PROMPT_COLUMNS} FROM run_prompts p WHERE {' AND '.join(clauses)}"),
            params,
        ):
            key = str(getattr(row, key_column))
            by_key.setdefault(key, [[] for _ in run_ids])[i].append(row)
    return by_key


def _after(matched: list[Any], after: str, digest: str) -> list[Any]:
    """The matches past the cursor `after`, which must be this comparison's."""
    _, digest_at, label_at, key_at = decode_cursor(after, "compare", 4)
    if digest_at != digest or not isinstance(label_at, str) or not isinstance(key_at, str):
        raise InvalidInput(
            "after: the cursor is for other runs or another match; start from the first page"
        )
    return [m for m in matched if (m[0], m[1]) > (label_at, key_at)]
