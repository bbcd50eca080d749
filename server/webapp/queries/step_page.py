"""The step viewer's reads: a step's groups overview (scalar columns only), one group's rollouts
with their arrays, the neighbours of a step and of a group, the nearest recorded step and the
nearest step whose token data retention kept."""

from __future__ import annotations

from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.errors import GroupNotFound, InvalidInput, NotFound, StepNotFound
from rollout_lens.server.core.read_models import GroupNav, ScalarRow, StepGroups, StepHead, StepNav
from rollout_lens.server.core.records import DISAGREE_AT
from rollout_lens.server.core.step_views import GroupDetail, StepCard
from rollout_lens.server.store import layout, prompt_texts
from rollout_lens.server.store.models import (
    FactsRow,
    RolloutRow,
    RunRow,
    StepRow,
)
from rollout_lens.server.store.serialize import completion_ids, read_rollout, run_dict, step_dict
from rollout_lens.server.webapp.queries import group_header, overview
from rollout_lens.server.webapp.queries.budget import page_token_limit
from rollout_lens.server.webapp.queries.runs import step_bounds
from sqlalchemy import and_, distinct, func, or_, select
from sqlalchemy.orm import Session

# --- step viewer --------------------------------------------------------------------------------


def _neighbours(session: Session, run_id: int, step: int) -> StepNav:
    """First, previous, next and last recorded steps around `step`: one statement of index seeks."""
    this_run = StepRow.run_id == run_id
    first, prev, nxt, last = session.execute(
        select(
            select(func.min(StepRow.step)).where(this_run).scalar_subquery(),
            select(func.max(StepRow.step)).where(this_run, StepRow.step < step).scalar_subquery(),
            select(func.min(StepRow.step)).where(this_run, StepRow.step > step).scalar_subquery(),
            select(func.max(StepRow.step)).where(this_run).scalar_subquery(),
        )
    ).one()
    return {"first": first, "prev": prev, "next": nxt, "last": last}


def nearest_step(session: Session, *, run_id: int, step: int) -> int | None:
    """The recorded step closest to `step`: itself if recorded; ties go to the earlier one."""
    if (
        session.scalar(select(StepRow.step).where(StepRow.run_id == run_id, StepRow.step == step))
        is not None
    ):
        return step
    around = _neighbours(session, run_id, step)
    below, above = around["prev"], around["next"]
    if below is None or above is None:
        return below if above is None else above
    return below if step - below <= above - step else above


# The overview's rows come from these columns only: never the token arrays or the completion.
SCALARS = (
    RolloutRow.group,
    RolloutRow.index,
    RolloutRow.vote,
    RolloutRow.target,
    RolloutRow.verifier_reward,
    RolloutRow.true_score,
    RolloutRow.advantage,
    RolloutRow.sum_logprob,
    RolloutRow.format_valid,
    RolloutRow.format_state,
    RolloutRow.prompt_id,
    RolloutRow.facts_id,
)
GROUPS_PER_PAGE = 100  # overview rows a page (HTML and JSON)
MAX_GROUPS_PER_PAGE = 500
ROLLOUTS_PER_PAGE = 16  # a group's rollouts in one JSON answer
MAX_ROLLOUTS_PER_PAGE = 32  # 32 × JSON_TOKENS positions: ~1.2 MB at 4 control tokens
# Per-token positions of each rollout in a group's JSON: 16 rollouts × 256 positions of ids,
# logprobs, token texts and 4 control tokens' probabilities are ~0.5 MB (the 2 MB ceiling).
JSON_TOKENS = 256
# What one group JSON answer holds at most, so that none passes 2 MB: token positions over all
# its rollouts (a page holds fewer rollouts when each asks for more positions; ~50 bytes each)
# and characters of each completion and prompt, JSON_TEXT_BUDGET shared by a page's rollouts
# but never fewer than JSON_TEXT_CHARS (`completion_chars` and `prompt_chars` say how many
# there are; the export has everything).
JSON_POSITIONS = 16_384
JSON_TEXT_CHARS = 16_000
JSON_TEXT_BUDGET = 500_000
GROUP_TABS = 64  # rollouts a group's page shows in full (tabs); the JSON pages every one
QUERY_CHARS = 500  # of a group's query read for its overview label


def disagrees_sql(verifier_reward: Any, true_score: Any) -> Any:
    """records.disagrees as an SQL condition over two columns (the explorer's `disagree=1`)."""
    cut = DISAGREE_AT
    return or_(
        and_(verifier_reward >= cut, true_score == 0),
        and_(verifier_reward < cut, true_score >= 1),
    )


def step_head(session: Session, *, run_id: int, step: int) -> tuple[StepRow, StepHead]:
    """A recorded step's row and what every view of it shows: run, step columns, metrics,
    neighbours, whether retention kept its token data (and the nearest step that kept it)."""
    run = store.get_run(session, run_id=run_id)
    row = session.scalar(select(StepRow).where(StepRow.run_id == run_id, StepRow.step == step))
    if row is None:
        raise StepNotFound(
            run_id=run_id, step=step, nearest=nearest_step(session, run_id=run_id, step=step)
        )
    kept = bool(row.tokens_kept)
    return row, {
        "run": run_dict(run),
        "step": step_dict(row),
        "metrics": dict(sorted(layout.named(row.series, run.series_names or []).items())),
        "nav": _neighbours(session, run_id, step),
        "tokens_kept": kept,
        "nearest_kept": None if kept else nearest_kept_step(session, run_id=run_id, step=step),
        "keep_tokens_every": run.keep_tokens_every,
    }


def _scalar_rows(
    session: Session, *, run_id: int, rollout_step: int, group: int | None = None
) -> list[ScalarRow]:
    """The scalar columns of a step's rollouts (or one group's), in group and index order."""
    query = select(*SCALARS).where(RolloutRow.run_id == run_id, RolloutRow.step == rollout_step)
    if group is not None:
        query = query.where(RolloutRow.group == group)
    rows = session.execute(query.order_by(RolloutRow.group, RolloutRow.index))
    return [
        ScalarRow(
            group=g,
            index=i,
            vote=vote,
            target=target,
            verifier_reward=reward,
            true_score=true,
            advantage=adv,
            sum_logprob=lp,
            format_valid=valid,
            format_state=state,
            prompt_id=prompt,
            facts_id=facts,
        )
        for g, i, vote, target, reward, true, adv, lp, valid, state, prompt, facts in rows
    ]


def _labels(session: Session, rows: list[ScalarRow]) -> dict[int, str]:
    """group → its label: the query its facts name, else its prompt's head past what the step's
    prompts share (overview.prompt_labels); two small reads over the distinct prompts and facts."""
    firsts: dict[int, ScalarRow] = {}
    for row in rows:
        firsts.setdefault(row["group"], row)
    prompt_ids = sorted({r["prompt_id"] for r in firsts.values()})
    facts_ids = sorted({r["facts_id"] for r in firsts.values() if r["facts_id"] is not None})
    heads = {
        prompt_id: text[: overview.PROMPT_READ]
        for prompt_id, text in prompt_texts.texts(session, prompt_ids).items()
    }
    queries: dict[int, str] = {}
    for start in range(0, len(facts_ids), 500):
        chunk = facts_ids[start : start + 500]
        found = session.execute(
            select(
                FactsRow.id,
                func.substr(FactsRow.data["query"].as_string(), 1, QUERY_CHARS),
                func.substr(FactsRow.data[("row", "query")].as_string(), 1, QUERY_CHARS),
            ).where(FactsRow.id.in_(chunk))
        )
        queries.update({i: q or r for i, q, r in found if q or r})
    by_prompt = overview.prompt_labels(heads)
    return {
        group: str(
            (queries.get(facts) if (facts := row["facts_id"]) is not None else None)
            or by_prompt.get(row["prompt_id"], "")
        )
        for group, row in firsts.items()
    }


def step_groups(
    session: Session,
    *,
    run_id: int,
    step: int,
    sort: str = "group",
    descending: bool = False,
    look: str | None = None,
    offset: int = 0,
    limit: int = GROUPS_PER_PAGE,
) -> StepGroups:
    """A step as its groups overview: one row a group (overview.group_summary) from the rollouts'
    scalar columns only, sorted by a overview.GROUP_SORTS column, optionally only the groups that
    need a `look` (overview.LOOKS), a page of `limit` rows from `offset`; `total` rows match and
    `counts` says how many groups each look finds."""
    if sort not in overview.GROUP_SORTS:
        raise InvalidInput(f"unknown sort {sort!r}: use one of {', '.join(overview.GROUP_SORTS)}")
    if look is not None and look not in overview.LOOKS:
        raise InvalidInput(f"unknown look {look!r}: use one of {', '.join(overview.LOOKS)}")
    row, head = step_head(session, run_id=run_id, step=step)
    rows = _scalar_rows(session, run_id=run_id, rollout_step=row.rollout_step)
    summaries = overview.group_summaries(rows, _labels(session, rows))
    counts = {name: sum(overview.needs_look(s, name) for s in summaries) for name in overview.LOOKS}
    chosen = [s for s in summaries if look is None or overview.needs_look(s, look)]
    ordered = overview.sort_groups(chosen, sort, descending=descending)
    return {
        **head,
        "groups_in_step": len(summaries),
        "rollouts_in_step": len(rows),
        "counts": counts,
        "sort": sort,
        "order": "desc" if descending else "asc",
        "look": look,
        "total": len(ordered),
        "offset": offset,
        "limit": limit,
        "groups": ordered[offset : offset + limit],
    }


def _group_neighbours(session: Session, *, run_id: int, rollout_step: int, group: int) -> GroupNav:
    """First, previous, next and last group around `group` at a step, and how many it has."""
    here = [RolloutRow.run_id == run_id, RolloutRow.step == rollout_step]
    first, prev, nxt, last, count = session.execute(
        select(
            select(func.min(RolloutRow.group)).where(*here).scalar_subquery(),
            select(func.max(RolloutRow.group))
            .where(*here, RolloutRow.group < group)
            .scalar_subquery(),
            select(func.min(RolloutRow.group))
            .where(*here, RolloutRow.group > group)
            .scalar_subquery(),
            select(func.max(RolloutRow.group)).where(*here).scalar_subquery(),
            select(func.count(distinct(RolloutRow.group))).where(*here).scalar_subquery(),
        )
    ).one()
    return {"first": first, "prev": prev, "next": nxt, "last": last, "count": count}


def _token_texts(
    session: Session,
    *,
    run: RunRow,
    rollouts: list[RolloutRow],
    limit: int | None,
    cache: store.TokenTextCache | None,
) -> dict[int, str]:
    """The texts of the token ids serialize.rollout_dict needs for these rollouts: every id of
    a rollout whose text is rebuilt from its ids, else those of its first `limit` positions (all
    when None); those `cache` keeps are not read again."""
    ids: set[int] = set()
    for r in rollouts:
        every = completion_ids(r)
        ids.update(every if limit is None or r.text_rule is not None else every[:limit])
    if cache is None:
        return store.token_texts(session, run_id=run.id, ids=ids)
    return cache.texts(session, run, ids)


def has_group(session: Session, *, run_id: int, step: int, group: int) -> bool:
    """Whether the update at `step` trained on rollouts of `group` (False for a missing step)."""
    rollout_step = select(StepRow.rollout_step).where(
        StepRow.run_id == run_id, StepRow.step == step
    )
    found = session.scalar(
        select(RolloutRow.id)
        .where(
            RolloutRow.run_id == run_id,
            RolloutRow.step == rollout_step.scalar_subquery(),
            RolloutRow.group == group,
        )
        .limit(1)
    )
    return found is not None


def group_detail(
    session: Session,
    *,
    run_id: int,
    step: int,
    group: int,
    max_tokens: int | None = None,
    offset: int = 0,
    limit: int | None = None,
    page_budget: bool = False,
    texts_kept: store.TokenTextCache | None = None,
) -> GroupDetail:
    """One group of a step: its overview row, its header (group_header.group_header), its neighbours,
    and its rollouts from `offset` (at most `limit`) with their arrays decoded by
    serialize.read_rollout (typed views), cut to `max_tokens` positions (with `page_budget`, to no more than
    a page shows of each: page_token_limit), their token texts read through
    `texts_kept` when given. GroupNotFound when the step has no such group."""
    row, head = step_head(session, run_id=run_id, step=step)
    scalars = _scalar_rows(session, run_id=run_id, rollout_step=row.rollout_step, group=group)
    if not scalars:
        raise GroupNotFound(run_id=run_id, step=step, group=group)
    if page_budget:
        shown = len(scalars[offset:] if limit is None else scalars[offset : offset + limit])
        budget = page_token_limit(shown)
        max_tokens = budget if max_tokens is None else min(max_tokens, budget)
    query = (
        select(RolloutRow)
        .where(
            RolloutRow.run_id == run_id,
            RolloutRow.step == row.rollout_step,
            RolloutRow.group == group,
        )
        .order_by(RolloutRow.index)
        .offset(offset)
    )
    if limit is not None:
        query = query.limit(limit)
    rollouts = prompt_texts.with_prompts(session, session.scalars(query).all())
    run = store.get_run(session, run_id=run_id)  # already in the session: no second read
    tokens = list(run.control_tokens)
    texts = _token_texts(
        session, run=run, rollouts=[r for r, _ in rollouts], limit=max_tokens, cache=texts_kept
    )
    views = [read_rollout(r, text, tokens, texts, max_tokens=max_tokens) for r, text in rollouts]
    return {
        **head,
        "tokens_kept": head["tokens_kept"] and all(r.tokens_kept for r, _ in rollouts),
        "group_nav": _group_neighbours(
            session, run_id=run_id, rollout_step=row.rollout_step, group=group
        ),
        "summary": overview.group_summary(scalars, ""),
        "prompt_id": scalars[0]["prompt_id"],
        "header": group_header.group_header(views) if views else None,
        "rollouts_total": len(scalars),
        "offset": offset,
        "rollouts": views,
    }


def step_card(
    session: Session,
    *,
    run_id: int,
    step: int,
    group: int = 0,
    max_tokens: int | None = 0,
    texts_kept: store.TokenTextCache | None = None,
) -> StepCard:
    """Compare's compact step: one group of it (group_detail; `max_tokens` per-token positions,
    none by default: the card shows no tokens, but its rollouts' texts are rebuilt from their
    ids' texts, read through `texts_kept` when given) and how many groups the step has. A step
    without that group (or without rollouts) has `header` None and no rollouts."""
    try:
        return group_detail(
            session,
            run_id=run_id,
            step=step,
            group=group,
            max_tokens=max_tokens,
            limit=GROUP_TABS,
            texts_kept=texts_kept,
        )
    except GroupNotFound:
        row, head = step_head(session, run_id=run_id, step=step)
        nav = _group_neighbours(session, run_id=run_id, rollout_step=row.rollout_step, group=group)
        return {
            **head,
            "group_nav": nav,
            "header": None,
            "asked_group": group,
            "rollouts": [],
            "rollouts_total": 0,
        }


def nearest_kept_step(session: Session, *, run_id: int, step: int) -> int | None:
    """The step nearest `step` whose token-level data retention kept (ties: the earlier)."""
    kept = [StepRow.run_id == run_id, StepRow.tokens_kept.is_(True)]
    row = session.execute(
        select(
            select(func.max(StepRow.step)).where(*kept, StepRow.step < step).scalar_subquery(),
            select(func.min(StepRow.step)).where(*kept, StepRow.step > step).scalar_subquery(),
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
        step_bounds(session, run_id=run_id)[1]
        if step is None
        else nearest_step(session, run_id=run_id, step=step)
    )
    if found is None:
        raise NotFound(f"run {run_id} has no recorded steps yet")
    return found
