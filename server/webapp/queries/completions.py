"""The completions a page lists by rollout id (a prompt's history): each one's head as the
explorer shows it, decoded for those rollouts alone."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_lens.server import store
from rollout_lens.server.store import arrays
from rollout_lens.server.store.models import RolloutRow
from rollout_lens.server.webapp.queries.explorer import HEAD_TOKENS, completion_head
from sqlalchemy import select
from sqlalchemy.orm import Session

BATCH = 500  # ids a statement (well under SQLite's bound on parameters)


def completion_heads(session: Session, *, run_id: int, ids: Sequence[int]) -> dict[int, str]:
    """rollout id → the head of its completion (its first tokens, cut as the explorer cuts),
    for the rollouts of `run_id` among `ids`."""
    rows: list[RolloutRow] = []
    for start in range(0, len(ids), BATCH):
        chunk = list(ids[start : start + BATCH])
        rows += session.scalars(
            select(RolloutRow).where(RolloutRow.run_id == run_id, RolloutRow.id.in_(chunk))
        ).all()
    heads = {
        r.id: arrays.decode_ids(r.data.ids)[:HEAD_TOKENS] if r.data is not None else []
        for r in rows
    }
    texts = store.token_texts(session, run_id=run_id, ids={i for h in heads.values() for i in h})
    return {r.id: completion_head(r, heads[r.id], texts) for r in rows}
