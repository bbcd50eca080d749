"""The step viewer's reads: a step's groups and rollouts, its neighbours, the nearest
recorded step and the nearest step whose token data retention kept."""

from __future__ import annotations

from typing import Any

from rollout_lens.server import store, viewer
from rollout_lens.server.errors import NotFound, StepNotFound
from rollout_lens.server.models import (
    Prompt,
    Rollout,
    Step,
)
from rollout_lens.server.queries.runs import _bounds
from rollout_lens.server.serialize import completion_ids, rollout_dict, run_dict, step_dict
from rollout_lens.server.store import layout
from sqlalchemy import func, select
from sqlalchemy.orm import Session

# --- step viewer --------------------------------------------------------------------------------


def _neighbours(session: Session, run_id: int, step: int) -> dict[str, int | None]:
    """First, previous, next and last recorded steps around `step`: one statement of index seeks."""
    this_run = Step.run_id == run_id
    first, prev, nxt, last = session.execute(
        select(
            select(func.min(Step.step)).where(this_run).scalar_subquery(),
            select(func.max(Step.step)).where(this_run, Step.step < step).scalar_subquery(),
            select(func.min(Step.step)).where(this_run, Step.step > step).scalar_subquery(),
            select(func.max(Step.step)).where(this_run).scalar_subquery(),
        )
    ).one()
    return {"first": first, "prev": prev, "next": nxt, "last": last}


def nearest_step(session: Session, *, run_id: int, step: int) -> int | None:
    """The recorded step closest to `step`: itself if recorded; ties go to the earlier one."""
    if (
        session.scalar(select(Step.step).where(Step.run_id == run_id, Step.step == step))
        is not None
    ):
        return step
    around = _neighbours(session, run_id, step)
    below, above = around["prev"], around["next"]
    if below is None or above is None:
        return below if above is None else above
    return below if step - below <= above - step else above


def step_detail(
    session: Session, *, run_id: int, step: int, max_tokens: int | None = None
) -> dict[str, Any]:
    """One step of a run as the step viewer shows it: its groups, rollouts and neighbours, and
    where retention did not keep its token-level data, the nearest step that has it (per-token
    arrays cut to `max_tokens` positions: serialize.rollout_dict)."""
    run = store.get_run(session, run_id=run_id)
    row = session.scalar(select(Step).where(Step.run_id == run_id, Step.step == step))
    if row is None:
        raise StepNotFound(
            run_id=run_id, step=step, nearest=nearest_step(session, run_id=run_id, step=step)
        )
    rollouts = session.execute(
        select(Rollout, Prompt.text)
        .join(Prompt, Prompt.id == Rollout.prompt_id)
        .where(Rollout.run_id == run_id, Rollout.step == row.rollout_step)
        .order_by(Rollout.group, Rollout.index)
    ).all()
    tokens = list(run.control_tokens)
    ids = {i for r, _ in rollouts for i in completion_ids(r)}  # a text may be rebuilt from all
    texts = store.token_texts(session, run_id=run_id, ids=ids)
    dicts = [rollout_dict(r, text, tokens, texts, max_tokens=max_tokens) for r, text in rollouts]
    kept = all(r.tokens_kept for r, _ in rollouts)
    return {
        "run": run_dict(run),
        "step": step_dict(row),
        "metrics": dict(sorted(layout.named(row.series, run.series_names or []).items())),
        "nav": _neighbours(session, run_id, step),
        "tokens_kept": kept,
        "nearest_kept": None if kept else nearest_kept_step(session, run_id=run_id, step=step),
        "keep_tokens_every": run.keep_tokens_every,
        "groups": viewer.group_views(dicts),
    }


def nearest_kept_step(session: Session, *, run_id: int, step: int) -> int | None:
    """The step nearest `step` whose token-level data retention kept (ties: the earlier)."""
    kept = [Step.run_id == run_id, Step.tokens_kept.is_(True)]
    row = session.execute(
        select(
            select(func.max(Step.step)).where(*kept, Step.step < step).scalar_subquery(),
            select(func.min(Step.step)).where(*kept, Step.step > step).scalar_subquery(),
        )
    ).one()
    below: int | None = row[0]
    above: int | None = row[1]
    if below is None or above is None:
        return below if above is None else above
    return below if step - below <= above - step else above


def resolve_step(session: Session, *, run_id: int, step: int | None) -> int:
    """The recorded step nearest `step` (the last one when None), for jump links and sliders."""
    store.get_run(session, run_id=run_id)
    found = (
        _bounds(session, run_id=run_id)[1]
        if step is None
        else nearest_step(session, run_id=run_id, step=step)
    )
    if found is None:
        raise NotFound(f"run {run_id} has no recorded steps yet")
    return found
