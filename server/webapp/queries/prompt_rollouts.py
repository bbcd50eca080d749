"""The rollouts of one prompt of a run over a span of its steps, with their completions: what a
prompt's history shows under each group (queries.prompts.prompt_history gives the figures)."""

from __future__ import annotations

from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.store.models import RolloutRow
from rollout_lens.server.store.serialize import completion_ids, completion_text
from rollout_lens.server.webapp.pages.stepview import state_name
from sqlalchemy import select
from sqlalchemy.orm import Session

MAX_ROLLOUTS = 2_000  # rollouts one read decodes (a history page of 250 groups of 8)
COMPLETION_CHARS = 4_000  # characters of each completion (the step viewer has it whole)


def prompt_rollouts(
    session: Session,
    *,
    run_id: int,
    prompt_id: int,
    first_step: int,
    last_step: int,
    max_chars: int = COMPLETION_CHARS,
) -> list[dict[str, Any]]:
    """The rollouts of `prompt_id` in `run_id` from `first_step` to `last_step`, in (step,
    group, index) order, at most MAX_ROLLOUTS: each one's id, step, group, index, reward, true
    score, advantage, vote, state and completion (its first `max_chars` characters;
    `completion_chars` says how many it has)."""
    if max_chars < 1:
        raise InvalidInput("max_chars: at least 1")
    store.get_run(session, run_id=run_id)
    rows = list(
        session.scalars(
            select(RolloutRow)
            .where(
                RolloutRow.run_id == run_id,
                RolloutRow.prompt_id == prompt_id,
                RolloutRow.step >= first_step,
                RolloutRow.step <= last_step,
            )
            .order_by(RolloutRow.step, RolloutRow.group, RolloutRow.index)
            .limit(MAX_ROLLOUTS)
        )
    )
    ids = {i for r in rows if r.text_rule is not None for i in completion_ids(r)}
    texts = store.token_texts(session, run_id=run_id, ids=ids) if ids else {}
    out = []
    for r in rows:
        whole = completion_text(r, completion_ids(r) if r.text_rule is not None else [], texts)
        out.append(
            {
                "id": r.id,
                "step": r.step,
                "group": r.group,
                "index": r.index,
                "verifier_reward": r.verifier_reward,
                "true_score": r.true_score,
                "advantage": r.advantage,
                "vote": r.vote,
                "state": state_name(r.format_valid, r.format_state),
                "completion": whole[:max_chars],
                "completion_chars": len(whole),
            }
        )
    return out
