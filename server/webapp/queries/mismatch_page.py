"""The mismatch drill-down's reads: a step's (or a range of steps') generator and trainer logprobs,
token by token, into the histogram of log-ratios, the scatter of both probabilities, the table by
the generator's probability and the worst tokens (server.core.mismatch_drill computes them).

Which rollouts: those of the steps' rollout steps whose mismatch figures the store computed
(rollouts.abs_diff_max not NULL: a generator side with a token to compare) and whose arrays
retention kept. A range is read step by step from its first and stops before the step that
would pass MAX_TOKENS (counted from the rollouts' n_tokens before any array is read; the first
step is always read whole) or after MAX_STEPS steps; the answer says where it stopped and where
the next range starts. Tool-result tokens are left out as the figures leave them out: the store
keeps the generator's logprob NaN there (server.core.mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from rollout_lens.server import store
from rollout_lens.server.core import mismatch, tokentext
from rollout_lens.server.core import mismatch_drill as drill
from rollout_lens.server.core.errors import InvalidInput, NotFound, StepNotFound
from rollout_lens.server.store import arrays
from rollout_lens.server.store.models import RolloutRow, StepRow
from rollout_lens.server.webapp.queries.step_page import nearest_step
from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import Session

MAX_STEPS = 50  # steps a range reads at most
MAX_TOKENS = 2_000_000  # completion tokens a range reads at most (4 steps of 512 × 1,000)
WORST = 20  # worst tokens listed
SCATTER_POINTS = 4_000  # points of the scatter: the worst tokens and a fixed-seed sample
CONTEXT = 4  # tokens shown either side of a worst token
DIGITS = 5  # decimals of a logprob sent (the store keeps steps of 1/4096 nat)


def has_generator_side(session: Session, *, run_id: int, step: int | None = None) -> bool:
    """Whether any rollout of the run (of its rollout step `step`) has a generator side to
    compare: its mismatch figures are known (one seek of the (run_id, abs_diff_max) index, or
    of the step's rollouts)."""
    found = select(RolloutRow.id).where(
        RolloutRow.run_id == run_id, RolloutRow.abs_diff_max.is_not(None)
    )
    if step is not None:
        found = found.where(RolloutRow.step == step)
    return session.scalar(found.limit(1)) is not None


@dataclass(frozen=True)
class Plan:
    """The steps asked for and which of them are read: `read` (step, rollout step) pairs in
    order, `unkept` the steps whose arrays retention dropped, `cut` whether the range stops
    before its end (then `next_from` is the first step not read)."""

    first: int
    last: int
    read: list[tuple[int, int]]
    unkept: list[int]
    cut: bool
    next_from: int | None


def _steps(session: Session, run_id: int, first: int, last: int) -> list[StepRow]:
    """The recorded steps from `first` to `last` (MAX_STEPS + 1 at most: one more says cut)."""
    rows = session.scalars(
        select(StepRow)
        .where(StepRow.run_id == run_id, StepRow.step >= first, StepRow.step <= last)
        .order_by(StepRow.step)
        .limit(MAX_STEPS + 1)
    ).all()
    return list(rows)


def _tokens_by_step(session: Session, run_id: int, rollout_steps: list[int]) -> dict[int, int]:
    """Completion tokens of each rollout step's compared rollouts (their n_tokens)."""
    if not rollout_steps:
        return {}
    rows = session.execute(
        select(RolloutRow.step, func.coalesce(func.sum(RolloutRow.n_tokens), 0))
        .where(
            RolloutRow.run_id == run_id,
            RolloutRow.step.in_(rollout_steps),
            RolloutRow.abs_diff_max.is_not(None),
        )
        .group_by(RolloutRow.step)
    )
    return {step: int(n or 0) for step, n in rows}


def plan(session: Session, *, run_id: int, first: int, last: int, one: bool) -> Plan:
    """Which steps of [first, last] are read (`one`: a single step, which must be recorded)."""
    rows = _steps(session, run_id, first, last)
    if not rows:
        if one:
            nearest = nearest_step(session, run_id=run_id, step=first)
            raise StepNotFound(run_id=run_id, step=first, nearest=nearest)
        raise NotFound(f"run {run_id} recorded no step from {first} to {last}")
    unkept = [r.step for r in rows[:MAX_STEPS] if not r.tokens_kept]
    kept = [r for r in rows[:MAX_STEPS] if r.tokens_kept]
    tokens = _tokens_by_step(session, run_id, sorted({r.rollout_step for r in kept}))
    read: list[tuple[int, int]] = []
    seen: set[int] = set()  # a rollout step reused by several steps (num_iterations) is read once
    total = 0
    stop = None
    for row in kept:
        if row.rollout_step in seen:
            continue
        n = tokens.get(row.rollout_step, 0)
        if read and total + n > MAX_TOKENS:
            stop = row.step
            break
        seen.add(row.rollout_step)
        read.append((row.step, row.rollout_step))
        total += n
    if stop is None and len(rows) > MAX_STEPS:
        stop = rows[MAX_STEPS].step
    unkept = [s for s in unkept if stop is None or s < stop]
    return Plan(first, last, read, unkept, stop is not None, stop)


@dataclass(frozen=True)
class Compared:
    """The rollouts read: each one's (id, step, group, index) and its two sides."""

    keys: list[tuple[int, int, int, int]]
    sides: list[mismatch.Sides]


_READ = text(
    'SELECT r.id, r.step, r."group", r.idx, d.logprobs, d.generator_logprobs '
    "FROM rollouts r JOIN rollout_data d ON d.rollout_id = r.id "
    "WHERE r.run_id = :run AND r.step IN :steps AND r.abs_diff_max IS NOT NULL "
    "AND d.logprobs IS NOT NULL AND d.generator_logprobs IS NOT NULL "
    'ORDER BY r.step, r."group", r.idx'
).bindparams(bindparam("steps", expanding=True))


def read_sides(session: Session, run_id: int, rollout_steps: list[int]) -> Compared:
    """The compared rollouts of `rollout_steps`, their blobs decoded (no ORM rows: a step of 512
    rollouts is 1,024 blobs)."""
    keys: list[tuple[int, int, int, int]] = []
    sides: list[mismatch.Sides] = []
    if not rollout_steps:
        return Compared(keys, sides)
    for rid, step, group, index, logprobs, generator in session.execute(
        _READ, {"run": run_id, "steps": rollout_steps}
    ):
        trainer, gen = arrays.decode_logprobs(logprobs), arrays.decode_logprobs(generator)
        if len(trainer) == len(gen):
            keys.append((rid, step, group, index))
            sides.append(mismatch.Sides(trainer, gen))
    return Compared(keys, sides)


def _round(values: np.ndarray) -> list[float]:
    return [round(v, DIGITS) for v in values.tolist()]


def worst_in_context(
    session: Session, run_id: int, found: Compared, tokens: mismatch.Pool, picked: np.ndarray
) -> list[dict[str, Any]]:
    """The worst tokens (`picked`: indices into `tokens`), each with its rollout, position,
    both logprobs and its text in a few tokens of context (the run's token texts)."""
    if not len(picked):
        return []
    rollout_ids = sorted({found.keys[int(tokens.rollout[i])][0] for i in picked})
    ids_of = {
        rid: arrays.decode_ids(blob)
        for rid, blob in session.execute(
            text("SELECT rollout_id, ids FROM rollout_data WHERE rollout_id IN :ids").bindparams(
                bindparam("ids", expanding=True)
            ),
            {"ids": rollout_ids},
        )
    }
    rules: dict[int, int | None] = {
        rid: rule
        for rid, rule in session.execute(
            select(RolloutRow.id, RolloutRow.text_rule).where(RolloutRow.id.in_(rollout_ids))
        )
    }
    windows: dict[int, tuple[int, int, list[int]]] = {}
    for i in picked:
        rid = found.keys[int(tokens.rollout[i])][0]
        at = int(tokens.position[i])
        ids = ids_of.get(rid, np.zeros(0, dtype=np.int64))
        windows[int(i)] = (rid, at, ids[max(0, at - CONTEXT) : at + CONTEXT + 1].tolist())
    texts = store.token_texts(
        session, run_id=run_id, ids={t for _, _, w in windows.values() for t in w}
    )
    out = []
    for i in picked:
        rid, at, window = windows[int(i)]
        _, step, group, index = found.keys[int(tokens.rollout[i])]
        out.append(
            {
                "step": step,
                "group": group,
                "index": index,
                "position": at,
                "log_ratio": round(float(tokens.log_ratios()[i]), DIGITS),
                "trainer_logprob": round(float(tokens.trainer[i]), DIGITS),
                "generator_logprob": round(float(tokens.generator[i]), DIGITS),
                **_in_context(window, min(at, CONTEXT), texts, rules.get(rid)),
            }
        )
    return out


def _in_context(
    window: list[int], at: int, texts: dict[int, str], rule: int | None
) -> dict[str, Any]:
    """A token's text with the text of the tokens around it ({"before", "token", "after"}; the
    token's id alone, and texts None, where the run kept no text for one of them)."""
    pieces = [texts.get(t) for t in window]
    if not window or None in pieces:
        token_id = window[at] if at < len(window) else None
        return {"token_id": token_id, "before": None, "token": None, "after": None}
    known: list[str] = pieces  # type: ignore[assignment]
    shown = tokentext.token_texts(known, tokentext.rule_for(rule, known), final=False)
    return {
        "token_id": window[at],
        "before": "".join(shown[:at]),
        "token": shown[at],
        "after": "".join(shown[at + 1 :]),
    }


def scatter_points(tokens: mismatch.Pool, found: Compared, worst: np.ndarray) -> dict[str, Any]:
    """The scatter's points: each one's two logprobs and its rollout's (step, group, index);
    `worst` (indices into `tokens`) are always among them."""
    shown = drill.sample(tokens, SCATTER_POINTS, worst)
    owners = [found.keys[int(k)] for k in tokens.rollout[shown].tolist()]
    return {
        "generator": _round(tokens.generator[shown]),
        "trainer": _round(tokens.trainer[shown]),
        "rollouts": [[step, group, index] for _, step, group, index in owners],
        "worst": np.flatnonzero(np.isin(shown, worst)).tolist(),
        "points": len(shown),
        "tokens": len(tokens.trainer),
    }


def _figures(found: Compared, tokens: mismatch.Pool) -> dict[str, Any]:
    """The histogram, the table by probability and the step's figures over the tokens read."""
    hist = drill.histogram(tokens.log_ratios())
    return {
        "figures": mismatch.pooled_figures(tokens.log_ratios(), tokens.counts()),
        "histogram": {
            "edges": hist.edges.tolist(),
            "counts": hist.counts.tolist(),
            "below": hist.below,
            "above": hist.above,
            "bands": list(hist.bands),
        },
        "by_probability": [vars(b) for b in drill.probability_table(tokens)],
    }


def mismatch_drill(
    session: Session,
    *,
    run_id: int,
    step: int | None = None,
    first: int | None = None,
    last: int | None = None,
) -> dict[str, Any]:
    """The drill-down of one recorded step (`step`; none given: the run's last) or of the
    steps from `first` to `last` (either end open: the run's first or last step), read within
    MAX_STEPS and MAX_TOKENS."""
    run = store.get_run(session, run_id=run_id)
    if step is not None and (first is not None or last is not None):
        raise InvalidInput("step: give a step, or a range (from, to), not both")
    one = first is None and last is None
    lo, hi = _range(session, run_id, step, first, last)
    if lo is None or hi is None:  # a run with no step yet
        raise NotFound(f"run {run_id} has recorded no step")
    if one:
        step, lo = hi, hi
    chosen = plan(session, run_id=run_id, first=lo, last=hi, one=one)
    found = read_sides(session, run_id, [r for _, r in chosen.read])
    tokens = mismatch.pool(found.sides)
    worst = drill.worst_of(tokens, WORST)
    return {
        "run": {"id": run.id, "name": run.name},
        "asked": {"step": step} if one else {"from": lo, "to": hi},
        "generator_side": has_generator_side(session, run_id=run_id),
        "bounds": {"max_steps": MAX_STEPS, "max_tokens": MAX_TOKENS},
        "steps": {
            "read": [s for s, _ in chosen.read],
            "first": chosen.read[0][0] if chosen.read else None,
            "last": chosen.read[-1][0] if chosen.read else None,
            "unkept": chosen.unkept,
            "cut": chosen.cut,
            "next_from": chosen.next_from,
        },
        "rollouts": len(found.sides),
        "tokens": len(tokens.trainer),
        **_figures(found, tokens),
        "worst": worst_in_context(session, run_id, found, tokens, worst),
        "scatter": scatter_points(tokens, found, worst),
    }


def _range(
    session: Session, run_id: int, step: int | None, first: int | None, last: int | None
) -> tuple[int | None, int | None]:
    """The steps asked for: `step` alone, else [first, last] with open ends at the run's first
    and last recorded steps (None, None: it has none); InvalidInput when first > last."""
    if step is not None:
        return step, step
    if first is not None and last is not None and first > last:
        raise InvalidInput(
            f"from: {first} is after to ({last}): a range runs from the earlier step"
        )
    if first is None or last is None:
        lo, hi = session.execute(
            select(func.min(StepRow.step), func.max(StepRow.step)).where(StepRow.run_id == run_id)
        ).one()
        first = lo if first is None else first
        last = hi if last is None else last
    return first, last
