"""The rollouts of one prompt of a run over a span of its steps, with their completions: what a
prompt's history shows under each group (queries.prompts.prompt_history gives the figures)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.store.models import RolloutRow
from rollout_lens.server.store.serialize import completion_ids, completion_text
from rollout_lens.server.webapp.queries.overview import state_name
from sqlalchemy import select
from sqlalchemy.orm import Session

MAX_ROLLOUTS = 2_000  # rollouts one read decodes (a history page of 250 groups of 8)
COMPLETION_CHARS = 4_000  # characters of each completion (the step viewer has it whole)
GROUPS_A_READ = 200  # (step, group)s a statement seeks (two parameters each)


def groups_sql(pairs: Sequence[tuple[int, int]]) -> tuple[str, dict[str, int]]:
    """A condition that holds for a rollout `r` in any of these (step, group)s, and its
    parameters: `step IN (…) AND group IN (…)`, seeks in the rollouts' (run, step, group,
    index) key on both databases (an OR of pairs is read as a scan of the run by SQLite). It
    holds for the other pairs of those steps and groups too: keep the rows of `pairs` alone."""
    steps, groups = sorted({s for s, _ in pairs}), sorted({g for _, g in pairs})
    params = {f"s{i}": s for i, s in enumerate(steps)} | {f"g{i}": g for i, g in enumerate(groups)}
    in_steps = ", ".join(f":s{i}" for i in range(len(steps)))
    in_groups = ", ".join(f":g{i}" for i in range(len(groups)))
    return f'(r.step IN ({in_steps}) AND r."group" IN ({in_groups}))', params


def prompt_rollouts(
    session: Session,
    *,
    run_id: int,
    prompt_id: int,
    first_step: int,
    last_step: int,
    groups: Sequence[tuple[int, int]] | None = None,
    max_chars: int = COMPLETION_CHARS,
) -> list[dict[str, Any]]:
    """The rollouts of `prompt_id` in `run_id` from `first_step` to `last_step` (of these
    (step, group)s alone where `groups` names them: a history page's, read by seeks), in
    (step, group, index) order, at most MAX_ROLLOUTS: each one's id, step, group, index,
    reward, true score, advantage, vote, state and completion (its first `max_chars`
    characters; `completion_chars` says how many it has)."""
    if max_chars < 1:
        raise InvalidInput("max_chars: at least 1")
    store.get_run(session, run_id=run_id)
    base = select(RolloutRow).where(
        RolloutRow.run_id == run_id,
        RolloutRow.prompt_id == prompt_id,
        RolloutRow.step >= first_step,
        RolloutRow.step <= last_step,
    )
    order = (RolloutRow.step, RolloutRow.group, RolloutRow.index)
    rows: list[RolloutRow] = []
    if groups is None:
        rows = list(session.scalars(base.order_by(*order).limit(MAX_ROLLOUTS)))
    for start in range(0, len(groups or ()), GROUPS_A_READ):
        chunk = list(groups or ())[start : start + GROUPS_A_READ]
        steps, numbers = {s for s, _ in chunk}, {g for _, g in chunk}
        found = session.scalars(
            base.where(RolloutRow.step.in_(steps), RolloutRow.group.in_(numbers)).order_by(*order)
        )
        rows += [r for r in found if (r.step, r.group) in set(chunk)]
    rows = rows[:MAX_ROLLOUTS]
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
