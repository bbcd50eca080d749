"""A group as the step viewer shows it: each rollout's read view with what the page draws
from it (ShownRollout, the page's projection), built at once (group_views)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_lens.server.core.mismatch import RolloutMismatch
from rollout_lens.server.core.read_models import GroupHeader
from rollout_lens.server.core.records import disagrees
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.webapp.pages.cells import (
    NEAR_MISS,
    Cells,
    ControlRows,
    control_rows,
    generator_side,
    token_cells,
    token_spans,
)
from rollout_lens.server.webapp.pages.turns import TurnView, turn_views
from rollout_lens.server.webapp.queries.budget import TABLE_TOKENS, page_token_limit
from rollout_lens.server.webapp.queries.group_header import group_header, turn_list


@dataclass(frozen=True, slots=True)
class ShownRollout(RolloutView):
    """A rollout as the step viewer shows it (the page's projection): the read view and what
    the page draws from it, built at once (shown_rollout), never changed after."""

    tokens_exact: bool  # the cells' texts are the real tokens (not ids)
    sampled: list[bool] | None  # a tool-calling rollout's positions the model sampled
    near_misses: list[list[str]]  # per position, control tokens likely there but not sampled
    own_prompt: bool  # its prompt differs from its group's
    disagree: bool  # verifier and truth disagree
    cells: Cells  # token_cells within the page's budget
    control_rows: ControlRows  # the control-token table's rows
    turn_views: list[TurnView] | None  # a tool-calling rollout's turns
    mismatch_stats: list[Stat]  # beside Σ logprob where it has a generator side (mismatch_stats)


Stat = tuple[str, str, str]  # a figure of a rollout's stats row: label, value, hover text


def mismatch_stats(rollout: RolloutView) -> list[Stat]:
    """A rollout's mismatch figures as its stats row shows them beside Σ logprob: max |Δlogp|
    and the sequence ratio, over all its compared tokens; none without a generator side."""
    if rollout.generator_logprobs is None:
        return []
    m = rollout.mismatch
    if m is None:
        why = "no token to compare: the generator gave no logprob where the trainer has one"
        return [("max |Δlogp|", "—", why), ("seq. ratio", "—", why)]
    over = f"over its {m.tokens:,} compared token{'' if m.tokens == 1 else 's'}"
    return [
        (
            "max |Δlogp|",
            f"{m.abs_diff_max:.3g}",
            f"the largest |trainer − generator logprob| of a sampled token, {over}",
        ),
        (
            "seq. ratio",
            f"{m.seq_ratio:.3g}",
            f"the sequence-level importance ratio Π p_trainer / p_generator, {over}",
        ),
    ]


def mismatch_json(figures: RolloutMismatch | None) -> dict[str, Any] | None:
    """A rollout's mismatch figures as its JSON twin sends them (None: nothing to compare)."""
    if figures is None:
        return None
    return {
        "tokens": figures.tokens,
        "abs_diff_max": figures.abs_diff_max,
        "seq_ratio": figures.seq_ratio,
    }


def shown_rollout(rollout: RolloutView, group_prompt: str, limit: int | None) -> ShownRollout:
    """What the viewer shows of a rollout: its cells (those starting in the first `limit`
    positions), probabilities, control-token table and turns."""
    spans, exact = token_spans(rollout)
    n = spans[-1].last + 1 if spans else 0  # the positions the cells cover
    # the view's array as the projection's list, once: probabilities, and each turn's Σ logprob
    logprobs: list[float] = rollout.token_logprobs.tolist()
    probs: list[float | None] = [math.exp(lp) for lp in logprobs[:n]]
    probs += [None] * (n - len(probs))
    control: dict[str, list[float | None]] = {}
    for t, column in rollout.control_token_probs.items():
        ps: list[float | None] = column[:n].tolist()
        control[t] = ps + [None] * (n - len(ps))
    sampled = sampled_positions(rollout.meta, n)
    if sampled is not None:  # tool results: not sampled, no probability to show
        probs = [p if keep else None for p, keep in zip(probs, sampled, strict=True)]
        control = {
            t: [p if k else None for p, k in zip(ps, sampled, strict=True)]
            for t, ps in control.items()
        }
    misses = [_near_misses(probs[i], control, i) for i in range(n)]
    ids = rollout.completion_ids.tolist()
    side = (
        None
        if rollout.generator_logprobs is None
        else generator_side(rollout.token_logprobs, rollout.generator_logprobs, n, sampled)
    )
    cells = token_cells(spans, ids, probs, control, sampled, misses, limit, side)
    # A tool-calling rollout's turns each show their own positions' table rows.
    table = limit if sampled is not None or limit is None else min(limit, TABLE_TOKENS)
    rows = control_rows(spans, probs, control, table)
    fields = {name: getattr(rollout, name) for name in RolloutView.__dataclass_fields__}
    return ShownRollout(
        **fields,
        tokens_exact=exact,
        sampled=sampled,
        near_misses=misses,
        own_prompt=rollout.prompt != group_prompt,
        disagree=disagrees(rollout.verifier_reward, rollout.true_score),
        cells=cells,
        control_rows=rows,
        turn_views=turn_views(rollout.meta, logprobs, control, cells, rows),
        mismatch_stats=mismatch_stats(rollout),
    )


def rollout_json(rollout: RolloutView, cut: int) -> dict[str, Any]:
    """A rollout as the group page's JSON twin sends it: the read view's data() with its texts
    cut to `cut` characters (and their lengths), and the marks the page shows of it: `disagree`,
    a tool-calling rollout's `sampled` positions (None: every one) and, where it has a
    generator side, its `mismatch` figures (mismatch_json: those of its stats row)."""
    out = {
        **rollout.data(),
        "completion": rollout.completion[:cut],
        "completion_chars": len(rollout.completion),
        "prompt": rollout.prompt[:cut],
        "prompt_chars": len(rollout.prompt),
        "disagree": disagrees(rollout.verifier_reward, rollout.true_score),
        "sampled": sampled_positions(rollout.meta, len(rollout.completion_ids)),
    }
    if rollout.generator_logprobs is not None:
        out["mismatch"] = mismatch_json(rollout.mismatch)
    return out


def sampled_positions(meta: dict[str, Any], n: int) -> list[bool] | None:
    """Per position of a tool-calling rollout, whether the model sampled it (its model turns);
    None for a single-turn rollout (every position sampled)."""
    turns = turn_list(meta)
    if turns is None:
        return None
    sampled = [False] * n
    for turn in turns:
        if turn["role"] == "model":
            for i in range(max(0, int(turn["start"])), min(n, int(turn["end"]))):
                sampled[i] = True
    return sampled


def _near_misses(
    sampled: float | None, control: Mapping[str, Sequence[float | None]], i: int
) -> list[str]:
    """Control tokens that were likely (p ≥ NEAR_MISS) at position i but not the token sampled."""
    out = []
    for token, probs in control.items():
        p = probs[i]
        if p is None or p < NEAR_MISS:
            continue
        if sampled is not None and math.isclose(p, sampled, rel_tol=1e-4, abs_tol=1e-6):
            continue
        out.append(token)
    return out


class GroupView(GroupHeader):
    """One group as the viewer shows it: its header and its rollouts' views."""

    rollouts: list[ShownRollout]
    two_sided: bool  # some rollout has a generator side: its tokens can be shaded by log r


def group_views(rollouts: Sequence[RolloutView]) -> list[GroupView]:
    """Rollouts (serialize.read_rollout's views, in group order) → one view per group: its
    header (group_header) and each rollout's view (shown_rollout: tokens, probabilities,
    disagreement), its cells within the page's budget (page_token_limit of the group's)."""
    by_group: dict[int, list[RolloutView]] = {}
    for rollout in rollouts:
        by_group.setdefault(rollout.group, []).append(rollout)
    views: list[GroupView] = []
    for members in by_group.values():
        limit = page_token_limit(len(members))
        shown = [shown_rollout(r, members[0].prompt, limit) for r in members]
        two_sided = any(r.generator_logprobs is not None for r in members)
        views.append(GroupView(**group_header(members), rollouts=shown, two_sided=two_sided))
    return views
