"""What a group's rollouts say about the group (group_header): prompt, query, target, the vote
and answer histograms, a tool-calling rollout's vote read from its turns, the hint."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollout_lens.server.core.read_models import GroupHeader
from rollout_lens.server.core.step_views import RolloutView
from rollout_lens.server.webapp.queries.overview import vote_histogram


def _row(meta: dict[str, Any]) -> dict[str, Any]:
    """The dataset row a recorded rollout kept (the callback keeps its small columns)."""
    row = meta.get("row")
    return row if isinstance(row, dict) else {}


def answer_histogram(members: Sequence[RolloutView]) -> list[dict[str, Any]]:
    """A tool-calling group's final answers (meta.answer: the last turn's text when it calls no
    tool) as vote_histogram rows; an answer is marked right when every rollout that gave it
    scored 1, and None means the rollout ended on a call."""
    answers = [r.meta.get("answer") for r in members]
    rows = vote_histogram(answers, None)
    for row in rows:
        scores = [members[i].true_score for i in row["rollouts"]]
        row["is_target"] = row["vote"] is not None and all((s or 0) >= 1 for s in scores)
    return rows


def turn_list(meta: dict[str, Any]) -> list[dict[str, Any]] | None:
    turns = meta.get("turns")
    if not isinstance(turns, list):
        return None
    return [t for t in turns if isinstance(t, dict) and t.get("role") in ("model", "tool")]


def first_call(turns: Sequence[dict[str, Any]]) -> str | None:
    """The name of the first tool a tool-calling rollout called (the first model turn with a
    call), if any: what runs recorded before `meta.first_call` stored as the vote."""
    for turn in turns:
        if turn.get("role") == "model":
            for call in turn.get("calls") or []:
                if isinstance(call, dict):
                    return str(call.get("name", ""))
    return None


_ANSWER_TAG = re.compile(r"\s*<answer>\s*([^<>]*?)\s*</answer>\s*")


def answer_vote(vote: str | None, meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """How a tool-calling rollout's vote reads; None for a single-turn rollout.

    Runs that record `meta.first_call` vote with the final answer: `vote` is the tool whose
    result gave the answer (`source`), else the answer text itself, else None; the first call
    is shown beside it. Runs recorded before (`legacy`) stored the first tool called as the
    vote: it is derived here from `meta.turns` and said to be the vote. `answer` is the final
    answer text (`meta.answer`), `answer_value` what a whole `<answer>V</answer>` holds."""
    meta = meta or {}
    turns = turn_list(meta)
    if turns is None:
        return None
    legacy = "first_call" not in meta
    first = first_call(turns) if legacy else meta.get("first_call")
    answer = meta.get("answer")
    answer = None if answer is None else str(answer)
    # the vote names a tool only when the rollout called a tool of that name; otherwise it is
    # the answer itself (as text or as the value the trainer read from it)
    called = {
        str(c.get("name")) for t in turns for c in t.get("calls") or [] if isinstance(c, dict)
    }
    source = vote if not legacy and vote is not None and vote in called else None
    return {
        "legacy": legacy,
        "vote": vote,
        "answer": answer,
        "answer_value": None if answer is None else answer_value(answer),
        "source": source,
        "first_call": None if first is None else str(first),
    }


def answer_value(answer: str) -> str:
    """What a final answer that is one whole `<answer>V</answer>` holds (V), else the text."""
    match = _ANSWER_TAG.fullmatch(answer)
    return match.group(1) if match and match.group(1) else answer


_HINT_PREFIX = re.compile(r"\s*hint\s*:\s*", re.IGNORECASE)


def hint_body(hint: Any) -> str:
    """A hint without its own leading "Hint:" (the page labels it already)."""
    text = "" if hint is None else str(hint)
    match = _HINT_PREFIX.match(text)
    return text[match.end() :] if match and match.end() < len(text) else text


def dataset_hint(meta: dict[str, Any]) -> Any:
    """The hint column of a rollout's dataset row: in meta (runs launched here) or in the row
    the callback kept (meta.row)."""
    hint = meta.get("hint")
    return hint if hint is not None else _row(meta).get("hint")


def group_header(members: Sequence[RolloutView]) -> GroupHeader:
    """What a group's rollouts (one group, in index order) say about the group: its prompt,
    query, target, vote histogram, agreement, correct count (no per-rollout views)."""
    first = members[0]
    meta = first.meta
    votes = [r.vote for r in members]
    valid = Counter(v for v in votes if v is not None)
    multi = [answer_vote(r.vote, r.meta) for r in members]
    kinds = {None if v is None else ("first_call" if v["legacy"] else "answer") for v in multi}
    vote_kind = next(iter(kinds)) if len(kinds) == 1 else "mixed"
    # The hint: the dataset's column, and the rollouts that saw it (hint supervision).
    hinted = [r for r in members if r.meta.get("supervised") == "hint"]
    hint = dataset_hint(meta)
    if hint is None and hinted:
        hint = hinted[0].meta.get("hint_shown")
    vote_rows = vote_histogram(votes, first.target)
    if vote_kind == "answer":  # a vote that is the answer itself: no tool result gave it
        sources = {v["source"] for v in multi if v is not None}
        for row in vote_rows:
            if row["vote"] is not None and row["vote"] not in sources:
                row["label"] = f"answer {answer_value(row['vote'])}"
    return {
        "group": first.group,
        "prompt": first.prompt,
        "query": meta.get("query") or _row(meta).get("query"),
        "target": first.target,
        "target_listed": meta.get("target_listed", _row(meta).get("target_listed")),
        "hint": None if hint is None else hint_body(hint),
        "hint_shown_to": [r.index for r in hinted],
        "tool_count": len(meta.get("tool_ids") or _row(meta).get("tool_ids") or []),
        "votes": vote_rows,
        # what a tool-calling group's votes are: "answer" (the tool that gave the final
        # answer), "first_call" (runs recorded before), None (single-turn), "mixed"
        "vote_kind": vote_kind,
        "first_calls": vote_histogram([v["first_call"] for v in multi if v is not None], None)
        if "answer" in kinds
        else [],
        "answers": answer_histogram(members) if any("turns" in r.meta for r in members) else [],
        "agree": max(valid.values()) if valid else 0,
        "size": len(members),
        "correct": sum(1 for r in members if (r.true_score or 0) >= 1),
        # Rollouts that are not the policy's own samples: origin → count.
        "supervised": dict(Counter(o for r in members if (o := r.meta.get("supervised")))),
    }
