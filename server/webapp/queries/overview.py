"""A step's groups overview: one row a group from its rollouts' scalar columns (group_summary),
sorted, filtered by what needs a look, labelled by where the step's prompts differ."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollout_lens.server.core.read_models import ScalarRow
from rollout_lens.server.core.records import disagrees


def vote_histogram(votes: Sequence[str | None], target: str | None) -> list[dict[str, Any]]:
    """Each distinct vote with its count and rollout indexes; most votes first, malformed last."""
    counts = Counter(votes)
    rows = [
        {
            "vote": vote,
            "count": count,
            "rollouts": [i for i, v in enumerate(votes) if v == vote],
            "is_target": vote is not None and vote == target,
        }
        for vote, count in counts.items()
    ]
    return sorted(
        rows, key=lambda r: (r["vote"] is None, -r["count"], not r["is_target"], r["vote"] or "")
    )


# --- groups overview: one row a group from the rollouts' scalar columns -----------------------

HEALTHY_STATE = "healthy_call"  # vocab.FormatState.healthy_call: a well-formed call
SPREAD_EPS = 1e-9  # rewards closer than this are equal (trainer.recorder.metrics.is_zero_std)


NO_CALL_STATE = "no_call"  # vocab.FormatState.no_call: no call at all
UNCHECKED_STATE = "unchecked"  # an import that did not check the format (dump_rows, two_sided)


def broken(format_valid: bool | None, format_state: str | None) -> bool:
    """A broken call: the completion is not format-valid, or its structural state is recorded and
    is a call gone wrong. No call at all is broken only where the format says so: a run that
    never needs a tool (a user's single-turn task) answers with no call, and that is its format.
    An import that did not check the format ("unchecked") knows of no problem."""
    if format_valid is False:
        return True
    return format_state is not None and format_state not in _NOT_BROKEN


_NOT_BROKEN = frozenset({HEALTHY_STATE, NO_CALL_STATE, UNCHECKED_STATE})


def state_name(format_valid: bool | None, format_state: str | None) -> str | None:
    """What a rollout's structure is called: its structural state, else valid or invalid by its
    format function; None when neither was recorded (no function: unknown, not invalid)."""
    if format_state:
        return format_state
    return None if format_valid is None else ("valid" if format_valid else "invalid")


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _std(values: Sequence[float]) -> float | None:
    """Population standard deviation (GRPO's group normalisation), None for no values."""
    if not values:
        return None
    mean = sum(values) / len(values)
    # d * d, not d ** 2: past 1e154 a product is inf where a power raises OverflowError
    return math.sqrt(sum(d * d for d in (v - mean for v in values)) / len(values))


def group_summary(rows: Sequence[ScalarRow], label: str) -> dict[str, Any]:
    """One overview row from a group's rollouts' scalar columns (group, index, vote, target,
    verifier_reward, true_score, advantage, sum_logprob, format_valid, format_state), in index
    order; `label` is what names the group (its query or its prompt's head: prompt_labels).

    solved: every rollout truly correct (true score 1). stuck: every rollout got the same reward
    (no reward spread, so no gradient) without the group being solved."""
    size = len(rows)
    rewards = _finite([r["verifier_reward"] for r in rows])
    scores = [r["true_score"] for r in rows]
    known = _finite(scores)
    votes = [r["vote"] for r in rows]
    valid = Counter(v for v in votes if v is not None)
    agree = max(valid.values()) if valid else 0
    advantages = _finite([r["advantage"] for r in rows])
    states = Counter(
        state for r in rows if (state := state_name(r["format_valid"], r["format_state"]))
    )
    disagree_at = [r["index"] for r in rows if disagrees(r["verifier_reward"], r["true_score"])]
    solved = bool(rows) and len(known) == size and all(s >= 1 for s in known)
    spread = max(rewards) - min(rewards) if rewards else None
    target = rows[0]["target"] if rows else None
    return {
        "group": rows[0]["group"] if rows else None,
        "label": label,
        "size": size,
        "target": target,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "reward_std": _std(rewards),
        "accuracy": sum(known) / len(known) if known else None,
        "correct": sum(1 for s in known if s >= 1),
        "votes": [
            {"vote": v["vote"], "count": v["count"], "is_target": v["is_target"]}
            for v in vote_histogram(votes, target)
        ],
        "agree": agree,
        "agreement": agree / size if size else None,
        "states": dict(sorted(states.items(), key=lambda kv: (-kv[1], kv[0]))),
        "broken": sum(1 for r in rows if broken(r["format_valid"], r["format_state"])),
        "disagree": len(disagree_at),
        "disagree_at": disagree_at,
        "solved": solved,
        "stuck": spread is not None and spread < SPREAD_EPS and not solved,
        "max_abs_advantage": max((abs(a) for a in advantages), default=None),
    }


def group_summaries(rows: Sequence[ScalarRow], labels: dict[int, str]) -> list[dict[str, Any]]:
    """Scalar rows of a step's rollouts (group, index order) → group_summary per group, in group
    order; `labels`: group → its label."""
    by_group: dict[int, list[ScalarRow]] = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row)
    return [group_summary(members, labels.get(g, "")) for g, members in by_group.items()]


# The overview's sortable columns: key → (header, numeric). Numeric columns sort with unknown
# values (None) last whatever the order; ties keep group order.
GROUP_SORTS: dict[str, tuple[str, bool]] = {
    "group": ("Group", True),
    "label": ("Prompt", False),
    "reward_mean": ("Reward", True),
    "reward_std": ("Spread", True),
    "accuracy": ("True acc.", True),
    "agreement": ("Agree", True),
    "broken": ("Broken", True),
    "disagree": ("Disagree", True),
    "max_abs_advantage": ("Max |adv.|", True),
}
# Groups that need a look (the overview's filters): name → label (needs_look tests a row).
LOOKS: dict[str, str] = {
    "disagree": "verifier ≠ truth",
    "stuck": "stuck",
    "broken": "broken calls",
    "solved": "solved",
}


def needs_look(summary: dict[str, Any], look: str) -> bool:
    """Whether an overview row belongs under the filter `look` (LOOKS)."""
    if look == "disagree":
        return bool(summary["disagree"])
    if look == "broken":
        return bool(summary["broken"])
    return bool(summary[look])  # stuck, solved


def sort_groups(
    summaries: Sequence[dict[str, Any]], sort: str, *, descending: bool
) -> list[dict[str, Any]]:
    """Overview rows by a GROUP_SORTS column; unknown values last, ties in group order (Python's
    sort is stable, reversed too)."""
    numeric = GROUP_SORTS[sort][1]
    known = sorted((s for s in summaries if s[sort] is not None), key=lambda s: s["group"])
    unknown = sorted((s for s in summaries if s[sort] is None), key=lambda s: s["group"])
    if numeric:
        known.sort(key=lambda s: s[sort], reverse=descending)
    else:
        known.sort(key=lambda s: str(s[sort]).casefold(), reverse=descending)
    return known + unknown


PROMPT_HEAD = 160  # characters of a prompt's distinguishing head the overview shows
PROMPT_READ = 2_000  # characters of each prompt read to find where the step's prompts differ
PROMPT_CONTEXT = 60  # characters of their line before where the prompts differ kept in a label


def prompt_labels(heads: dict[int, str]) -> dict[int, str]:
    """Each prompt's head (prompt id → its first PROMPT_READ characters) past what every prompt of
    the step shares (a system prompt, a chat template's preamble) from the start of the line where
    they part (or of the word, when that line began more than PROMPT_CONTEXT characters before),
    PROMPT_HEAD characters of it; '…' marks what was skipped."""
    texts = list(heads.values())
    common = 0
    if len(texts) > 1:
        common = len(os.path.commonprefix(texts))
        # back to the start of the line where the prompts part (a question's first words), or
        # of the word when that line started long before
        line = texts[0].rfind("\n", 0, common) + 1
        if common - line <= PROMPT_CONTEXT:
            common = line
        while common > 0 and not texts[0][common - 1].isspace():
            common -= 1
    out = {}
    for prompt_id, text in heads.items():
        start = common if common < len(text) else 0
        head = text[start : start + PROMPT_HEAD].strip()
        out[prompt_id] = ("…" if start else "") + head
    return out
