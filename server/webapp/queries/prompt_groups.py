"""The prompt lens's reads of the per-group rollups (`prompt_groups`): the heatmap of a page of
a run's prompts (the prompts list's rows, its order and cursor) × steps or buckets of steps, and
one prompt's history, every group of it in (step, group) order with its rollouts."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rollout_lens.server.core.errors import InvalidInput, NotFound
from rollout_lens.server.core.prompt_rules import votes_object
from rollout_lens.server.store.prompt_rollups import stored_votes
from rollout_lens.server.webapp.queries.explorer import MAX_ID
from rollout_lens.server.webapp.queries.keyset import encode_cursor, whole_number
from rollout_lens.server.webapp.queries.overview import state_name
from rollout_lens.server.webapp.queries.prompt_rollouts import (
    GROUPS_A_READ,
    MAX_ROLLOUTS,
    groups_sql,
    prompt_rollouts,
)
from rollout_lens.server.webapp.queries.prompts import (
    HEATMAP_COLUMNS,
    HISTORY_PAGE,
    LABEL_HEAD,
    MAX_COLUMNS,
    MAX_HISTORY,
    PROMPT_COLUMNS,
    PromptQuery,
    decode_cursor,
    distinguishing_labels,
    list_page,
    prompt_figures,
    prompt_texts,
    run_head,
)
from sqlalchemy import text
from sqlalchemy.orm import Session


def _step_span(session: Session, run_id: int) -> tuple[int, int] | None:
    row = session.execute(
        text("SELECT min(step), max(step) FROM prompt_groups WHERE run_id = :run"), {"run": run_id}
    ).one()
    return None if row[0] is None else (int(row[0]), int(row[1]))


def _groups_of(
    session: Session,
    run_id: int,
    prompt_ids: Sequence[int],
    extra: str = "",
    limit: int | None = None,
    **params: Any,
) -> list[Any]:
    """The group rows of these prompts in (prompt, step, group) order; `extra` more conditions
    on `g`, `limit` rows at most."""
    if not prompt_ids:
        return []
    tail = ""
    if limit is not None:
        tail, params["limit"] = " LIMIT :limit", limit
    marks = ", ".join(f":p{i}" for i in range(len(prompt_ids)))
    return list(
        session.execute(
            text(
                'SELECT g.prompt_id, g.step, g."group", g.size, g.reward_mean, g.reward_min, '
                "g.reward_max, g.reward_n, g.true_n, g.true_mean, g.correct, g.solved, "
                "g.zero_spread, g.agreement, g.votes FROM prompt_groups g "
                f"WHERE g.run_id = :run AND g.prompt_id IN ({marks}){extra} "
                f'ORDER BY g.prompt_id, g.step, g."group"{tail}'
            ),
            {"run": run_id} | {f"p{i}": p for i, p in enumerate(prompt_ids)} | params,
        )
    )


def _cell_groups(session: Session, run_id: int, prompt_ids: Sequence[int]) -> Sequence[Any]:
    """What a heatmap cell needs of these prompts' groups, in (prompt, step, group) order."""
    if not prompt_ids:
        return []
    marks = ", ".join(f":p{i}" for i in range(len(prompt_ids)))
    return session.execute(
        text(
            'SELECT g.prompt_id, g.step, g."group", g.reward_mean, g.reward_n, g.true_mean, '
            "g.true_n, g.solved, g.zero_spread FROM prompt_groups g "
            f"WHERE g.run_id = :run AND g.prompt_id IN ({marks}) "
            'ORDER BY g.prompt_id, g.step, g."group"'
        ),
        {"run": run_id} | {f"p{i}": p for i, p in enumerate(prompt_ids)},
    ).all()


def _cell(col: int, c: list[Any]) -> dict[str, Any]:
    """A heatmap cell from its sums (heatmap's positions)."""
    reward = c[8] / c[9] if c[9] else None
    true = c[10] / c[11] if c[11] else None
    return {
        "col": col,
        "first_step": c[0],
        "last_step": c[1],
        "step": c[2],
        "group": c[3],
        "groups": c[4],
        "solved": c[5],
        "failed": c[6],
        "zero_spread": c[7],
        "reward_mean": reward,
        "true_mean": true,
        "score": "true" if c[11] else "reward",
        "value": true if c[11] else reward,
    }


def _bucket_cells(
    groups: Iterable[Sequence[Any]], lo: int, bucket: int
) -> dict[int, dict[int, list[Any]]]:
    """The heatmap's cells from its groups (_cell_groups' rows), by prompt and column."""
    # [first step, last step, step, group, groups, solved, failed, zero spread, Σ reward,
    # rewards, Σ true, trues] a cell, by prompt and column: positions, not a dict a group
    cells: dict[int, dict[int, list[Any]]] = {}
    for (
        prompt_id,
        step,
        group,
        reward_mean,
        reward_n,
        true_mean,
        true_n,
        solved,
        flat,
    ) in groups:
        col = (step - lo) // bucket
        row_cells = cells.get(prompt_id)
        if row_cells is None:
            row_cells = cells[prompt_id] = {}
        cell = row_cells.get(col)
        if cell is None:
            cell = row_cells[col] = [step, step, step, group, 0, 0, 0, 0, 0.0, 0, 0.0, 0]
        cell[1] = step
        cell[4] += 1
        if solved is not None:
            cell[5 if solved else 6] += 1
        cell[7] += bool(flat)
        if reward_mean is not None:
            cell[8] += reward_mean * reward_n
            cell[9] += reward_n
        if true_mean is not None:
            cell[10] += true_mean * true_n
            cell[11] += true_n
    return cells


def heatmap(
    session: Session, *, run_id: int, query: PromptQuery, width: int = HEATMAP_COLUMNS
) -> dict[str, Any]:
    """Prompts × steps: a page of the prompts `query` lists (its order, its cursor), each a row
    of cells, a cell a step, or a bucket of `bucket` steps where the run has more steps than
    `width` columns. A cell's value is its groups' true score mean (`score` "true"), or their
    reward mean where none has a true score (`score` "reward"); it names the first group of
    its steps (`step`, `group`) for the step viewer."""
    if not 1 <= width <= MAX_COLUMNS:
        raise InvalidInput(f"width: from 1 to {MAX_COLUMNS:,} columns")
    run = run_head(session, run_id)
    rows, total, cursor = list_page(session, run_id, query)
    span = _step_span(session, run_id)
    lo, hi = span if span is not None else (0, -1)
    bucket = max(1, math.ceil((hi - lo + 1) / width)) if span is not None else 1
    columns = (hi - lo) // bucket + 1 if span is not None else 0
    cells = _bucket_cells(_cell_groups(session, run_id, [r.prompt_id for r in rows]), lo, bucket)
    out_rows = []
    for r in rows:
        out_rows.append(
            {
                "prompt_id": r.prompt_id,
                "label": r.label[:LABEL_HEAD],
                "solved_at": r.solved_at,
                "flips": r.flips,
                "cells": [_cell(col, c) for col, c in cells.get(r.prompt_id, {}).items()],
            }
        )
    return {
        "run": run,
        "first_step": lo if span is not None else None,
        "last_step": hi if span is not None else None,
        "bucket": bucket,
        "columns": columns,
        "rows": out_rows,
        "total": total,
        "next": cursor,
        "filters": query.filters(),
    }


# --- one prompt's history --------------------------------------------------------------------


def _prompt_row(session: Session, run_id: int, prompt_id: int) -> Any:
    row = session.execute(
        text(
            f"SELECT {PROMPT_COLUMNS} FROM run_prompts p WHERE p.run_id = :run AND p.prompt_id = :prompt"
        ),
        {"run": run_id, "prompt": prompt_id},
    ).first()
    if row is None:
        raise NotFound(f"run {run_id} has no prompt {prompt_id}")
    return row


def _rollouts_of(
    session: Session, run_id: int, prompt_id: int, groups: Sequence[Any], *, completions: bool
) -> list[dict[str, Any]]:
    """The rollouts of these groups of the prompt (a page of its history, in order), with
    their completions when asked (prompt_rollouts), else their scalar columns alone. Read by
    seeks in the rollouts' (run, step, group, index) key (groups_sql): a step range would read
    every rollout between the prompt's first and last groups on SQLite."""
    pairs = [(g.step, g.group) for g in groups]
    if completions:
        return prompt_rollouts(
            session,
            run_id=run_id,
            prompt_id=prompt_id,
            first_step=pairs[0][0],
            last_step=pairs[-1][0],
            groups=pairs,
        )
    out = []
    for start in range(0, len(pairs), GROUPS_A_READ):
        where, params = groups_sql(pairs[start : start + GROUPS_A_READ])
        rows = session.execute(
            text(
                'SELECT r.id, r.step, r."group", r.idx, r.verifier_reward, r.true_score, '
                "r.advantage, r.vote, r.format_valid, r.format_state FROM rollouts r "
                f"WHERE r.run_id = :run AND r.prompt_id = :prompt AND {where} "
                'ORDER BY r.step, r."group", r.idx'
            ),
            {"run": run_id, "prompt": prompt_id, **params},
        )
        wanted = set(pairs[start : start + GROUPS_A_READ])
        out += [
            {
                "id": r.id,
                "step": r.step,
                "group": r.group,
                "index": r.idx,
                "verifier_reward": r.verifier_reward,
                "true_score": r.true_score,
                "advantage": r.advantage,
                "vote": r.vote,
                "state": state_name(r.format_valid, r.format_state),
            }
            for r in rows
            if (r.step, r.group) in wanted
        ]
    return out


def _after(after: str | None, run_id: int, prompt_id: int) -> tuple[str, dict[str, Any]]:
    """A history cursor (`after`) as the SQL that starts past it and its parameters."""
    if after is None:
        return "", {}
    _, run_at, prompt_at, step_at, group_at = decode_cursor(after, "history", 5)
    if (run_at, prompt_at) != (run_id, prompt_id) or not (
        whole_number(step_at, -MAX_ID - 1, MAX_ID) and whole_number(group_at, -MAX_ID - 1, MAX_ID)
    ):
        raise InvalidInput("after: not a cursor of this prompt's history")
    extra = ' AND (g.step > :at_step OR (g.step = :at_step AND g."group" > :at_group))'
    return extra, {"at_step": step_at, "at_group": group_at}


def _history_step(g: Any, rs: Sequence[dict[str, Any]], completions: bool) -> dict[str, Any]:
    """One group of a prompt's history: its figures and its rollouts' (`rs`, index order)."""
    written = {"completions": [r["completion"] for r in rs]} if completions else {}
    return {
        "step": g.step,
        "group": g.group,
        "size": g.size,
        "reward_mean": g.reward_mean,
        "reward_min": g.reward_min,
        "reward_max": g.reward_max,
        "true_mean": g.true_mean,
        "correct": g.correct,
        "solved": None if g.solved is None else bool(g.solved),
        "zero_spread": bool(g.zero_spread),
        "agreement": g.agreement,
        "votes": votes_object(stored_votes(g.votes)),
        "rollout_ids": [r["id"] for r in rs],
        "indexes": [r["index"] for r in rs],
        "rewards": [r["verifier_reward"] for r in rs],
        "true_scores": [r["true_score"] for r in rs],
        "advantages": [r["advantage"] for r in rs],
        "rollout_votes": [r["vote"] for r in rs],
        "states": [r["state"] for r in rs],
        **written,
    }


def prompt_history(
    session: Session,
    *,
    run_id: int,
    prompt_id: int,
    after: str | None = None,
    limit: int = HISTORY_PAGE,
    completions: bool = False,
) -> dict[str, Any]:
    """Every group of one prompt of the run in (step, group) order, `limit` a page: its
    figures, its rollouts' rewards, true scores, advantages, votes, states and ids; the
    prompt's figures and whole text. `completions`: each group's completions too (the heads of
    COMPLETION_CHARS; a page then holds at most MAX_ROLLOUTS rollouts)."""
    if not 1 <= limit <= MAX_HISTORY:
        raise InvalidInput(f"limit: from 1 to {MAX_HISTORY:,} groups")
    run = run_head(session, run_id)
    if not 1 <= prompt_id <= 2**63 - 1:
        raise NotFound(f"run {run_id} has no prompt {prompt_id}")
    head = _prompt_row(session, run_id, prompt_id)
    extra, params = _after(after, run_id, prompt_id)
    groups = _groups_of(session, run_id, [prompt_id], extra, limit=limit + 1, **params)
    if completions:  # no more rollouts than one read decodes (one group at least)
        size = 0
        for n, g in enumerate(groups[:limit]):
            size += g.size
            if size > MAX_ROLLOUTS and n > 0:
                limit = n
                break
    cursor = None
    if len(groups) > limit:
        groups = groups[:limit]
        cursor = encode_cursor(["history", run_id, prompt_id, groups[-1].step, groups[-1].group])
    members: dict[tuple[int, int], list[Any]] = {}
    if groups:
        for r in _rollouts_of(session, run_id, prompt_id, groups, completions=completions):
            members.setdefault((r["step"], r["group"]), []).append(r)
    steps = [_history_step(g, members.get((g.step, g.group), []), completions) for g in groups]
    whole = prompt_texts(session, [prompt_id]).get(prompt_id, "")
    prompt = prompt_figures(head) | {
        "label": distinguishing_labels(session, run_id, [head], {prompt_id: whole})[prompt_id],
        "text": whole,
        "votes": votes_object(stored_votes(head.votes)),
    }
    return {"run": run, "prompt": prompt, "steps": steps, "next": cursor}
