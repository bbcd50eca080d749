"""Pure shaping of one step for the step viewer: groups, vote histograms, tokens with probabilities."""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired

from rollout_lens.server.core import tokentext
from rollout_lens.server.core.read_models import GroupHeader, ScalarRow
from rollout_lens.server.core.records import ControlProbs, disagrees
from rollout_lens.server.core.step_views import RolloutView
from typing_extensions import TypedDict

# The tiny model's pieces (tags, turn markers, ids, words with their leading space, punctuation,
# whitespace): when the completion splits into as many pieces as it has ids, piece i is token i.
_PIECES = re.compile(r"</?(?:tool|assistant|user)>|\n- |tool_\d+| ?(?!tool_\d)[^\W_]+|[^\w\s]|\s")


NEAR_MISS = 0.3  # a control token this likely where it was not sampled is a near format break

# What one page shows of a rollout: a completion of a million characters (or tokens) must not
# make the step viewer slow or huge. The JSON twin has everything; pages say what they cut.
VIEW_TOKENS = 512  # token positions with a view (cells, probabilities, control-token rows)
SHOWN_CHARS = 20_000  # characters of a completion, prompt, query or hint a page shows
SPLIT_CHARS_PER_TOKEN = 64  # longer texts are not split into the tiny tokenizer's pieces
# A token cell costs ~20 µs to build and render and a table cell ~5 µs: the step viewer shows
# at most PAGE_TOKENS cells across a group's tab panels, and a control-token table of the first
# TABLE_TOKENS positions (the hover text of each cell has the same numbers).
PAGE_TOKENS = 2048
MIN_PAGE_TOKENS = 128
TABLE_TOKENS = 64


def _matching_control_token(prob: float, control: ControlProbs, position: int) -> str | None:
    """The control token whose probability equals the sampled token's (so it was the one sampled)."""
    for token, probs in control.items():
        if position < len(probs) and math.isclose(
            probs[position],
            prob,
            rel_tol=2e-3,
            abs_tol=1e-4,  # float16 both sides
        ):
            return token
    return None


def token_spans(
    rollout: RolloutView, limit: int = VIEW_TOKENS
) -> tuple[list[tokentext.Cell], bool]:
    """The first `limit` completion tokens as cells (tokentext.Cell: a text and the positions
    first…last it covers), and whether the texts are the real tokens.

    From the pieces the recorder stored (`token_pieces`, read by the rule that gave `tokens`):
    a cell a token, except that tokens carrying parts of one UTF-8 character share a cell. Else
    from `tokens` alone, or the completion text split as the tiny model's tokenizer splits it;
    else each position is labelled by its id (or by the control token that was sampled there,
    recognised by its probability). A completion longer than `limit` tokens is labelled, not
    split: splitting must read all of its text.
    """
    ids = rollout.completion_ids  # maybe only the first ones (tokens_total)
    total = rollout.tokens_total
    shown = min(total, limit, len(ids))
    stored = rollout.tokens  # each id's text, when the recorder stored its piece
    pieces = rollout.token_pieces
    if isinstance(stored, list) and len(stored) == len(ids):
        if isinstance(pieces, list) and len(pieces) == len(ids):
            rule = tokentext.matching_rule(pieces[:shown], stored[:shown])
            return tokentext.cells(pieces[:shown], rule, final=shown == total), True
        return _single(str(t) for t in stored[:shown]), True
    logprobs = rollout.token_logprobs
    control = rollout.control_token_probs

    def label(i: int) -> str:
        found = (
            _matching_control_token(math.exp(logprobs[i]), control, i)
            if i < len(logprobs)
            else None
        )
        return tokentext.piece_text(found) if found is not None else f"⟨{ids[i]}⟩"

    text = rollout.completion
    if total == len(ids) <= limit and len(text) <= limit * SPLIT_CHARS_PER_TOKEN:
        split = _split(text, len(ids) + 1)
        if split is not None and len(split) == len(ids):
            return _single(split), True
        # The end-of-turn token is special: decoding drops it from the text.
        if split is not None and len(split) == len(ids) - 1:
            return _single([*split, label(len(ids) - 1)]), True
    return _single(label(i) for i in range(shown)), False


def _single(texts: Iterable[str]) -> list[tokentext.Cell]:
    """A cell a token."""
    return [tokentext.Cell(text, i, i) for i, text in enumerate(texts)]


def _split(text: str, most: int) -> list[str] | None:
    """`text` as the tiny tokenizer's pieces, or None when it has more than `most` pieces or
    characters no piece matches (stops early: a hostile text costs no more than a short one)."""
    pieces: list[str] = []
    end = 0
    for match in _PIECES.finditer(text):
        if match.start() != end or len(pieces) == most:
            return None
        pieces.append(match.group())
        end = match.end()
    return pieces if end == len(text) else None


def probability_bin(p: float | None) -> int:
    """0–9: the shade class of a probability (CSS classes p0…p9, no inline styles)."""
    if p is None or not math.isfinite(p):
        return 0
    return min(9, max(0, int(p * 10)))


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


class TokenCell(TypedDict):
    """A token cell as the page draws it (token_cells)."""

    text: str  # what the cell's tokens contribute
    first: int  # the positions it covers, first…last
    last: int
    cls: str  # CSS classes: its probability's shade, near-miss, tool-tok
    title: str  # hover text: positions, ids, probabilities


Cells = list[TokenCell]
ControlRows = list[tuple[str, list[tuple[str, str]]]]  # control_rows: label, (class, text)


@dataclass(frozen=True, slots=True)
class ShownRollout(RolloutView):
    """A rollout as the step viewer shows it: the read side's view and what the page draws
    from it, built at once (shown_rollout), never changed after."""

    token_view: list[tokentext.Cell]  # token_spans: a cell a token (or a split character)
    tokens_exact: bool  # the cells' texts are the real tokens (not ids)
    token_probs: list[float | None]  # the sampled token's probability at each shown position
    control_view: dict[str, list[float | None]]  # control token → its probability there
    sampled: list[bool] | None  # a tool-calling rollout's positions the model sampled
    near_misses: list[list[str]]  # per position, control tokens likely there but not sampled
    own_prompt: bool  # its prompt differs from its group's
    disagree: bool  # verifier and truth disagree
    cells: Cells  # token_cells within the page's budget
    control_rows: ControlRows  # the control-token table's rows
    turn_views: list[TurnView] | None  # a tool-calling rollout's turns


def shown_rollout(rollout: RolloutView, group_prompt: str, limit: int | None) -> ShownRollout:
    """What the viewer shows of a rollout: its cells (those starting in the first `limit`
    positions), probabilities, control-token table and turns."""
    spans, exact = token_spans(rollout)
    n = spans[-1].last + 1 if spans else 0  # the positions the cells cover
    probs: list[float | None] = [math.exp(lp) for lp in rollout.token_logprobs[:n].tolist()]
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
    ids, logprobs = rollout.completion_ids.tolist(), rollout.token_logprobs.tolist()
    cells = token_cells(spans, ids, probs, control, sampled, misses, limit)
    # A tool-calling rollout's turns each show their own positions' table rows.
    table = limit if sampled is not None or limit is None else min(limit, TABLE_TOKENS)
    rows = control_rows(spans, probs, control, table)
    fields = {name: getattr(rollout, name) for name in RolloutView.__dataclass_fields__}
    return ShownRollout(
        **fields,
        token_view=spans,
        tokens_exact=exact,
        token_probs=probs,
        control_view=control,
        sampled=sampled,
        near_misses=misses,
        own_prompt=rollout.prompt != group_prompt,
        disagree=disagrees(rollout.verifier_reward, rollout.true_score),
        cells=cells,
        control_rows=rows,
        turn_views=turn_views(rollout.meta, logprobs, control, cells, rows),
    )


def _turn_list(meta: dict[str, Any]) -> list[dict[str, Any]] | None:
    turns = meta.get("turns")
    if not isinstance(turns, list):
        return None
    return [t for t in turns if isinstance(t, dict) and t.get("role") in ("model", "tool")]


def sampled_positions(meta: dict[str, Any], n: int) -> list[bool] | None:
    """Per position of a tool-calling rollout, whether the model sampled it (its model turns);
    None for a single-turn rollout (every position sampled)."""
    turns = _turn_list(meta)
    if turns is None:
        return None
    sampled = [False] * n
    for turn in turns:
        if turn["role"] == "model":
            for i in range(max(0, int(turn["start"])), min(n, int(turn["end"]))):
                sampled[i] = True
    return sampled


def _arguments_text(arguments: Any) -> str:
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True)


class CallView(TypedDict):
    """A tool call of a turn, as the conversation shows it (untrusted text: escaped)."""

    name: str
    arguments: str
    result: str | None
    result_json: str | None  # the result pretty-printed when it is JSON or a Python literal


class TurnView(TypedDict):
    """A turn of a tool-calling rollout (turn_views): a model turn, or a tool stretch."""

    role: str  # model or tool
    start: int  # its positions [start, end)
    end: int
    calls: list[CallView]
    cells: Cells
    # a model turn's only
    number: NotRequired[int]
    state: NotRequired[dict[str, str] | None]
    sum_logprob: NotRequired[float | None]
    control_rows: NotRequired[ControlRows]
    control_summary: NotRequired[list[tuple[str, str, int]]]


def turn_views(
    meta: dict[str, Any],
    logprobs: Sequence[float],
    control: Mapping[str, Sequence[float | None]],
    cells: Cells,
    rows: ControlRows,
) -> list[TurnView] | None:
    """A tool-calling rollout (its meta, logprobs and shown control-token probabilities) as a
    conversation: per model turn its token cells, control-token rows and Σ logprob; per tool
    stretch each call's name, arguments and result (untrusted text: the template escapes it)
    and its token cells. None for a single-turn rollout."""
    turns = _turn_list(meta)
    if turns is None:
        return None
    recorded = meta.get("turn_states")
    states: list[Any] = recorded if isinstance(recorded, list) else []
    n = cells[-1]["last"] + 1 if cells else 0  # positions the cells cover
    firsts = [c["first"] for c in cells]
    views: list[TurnView] = []
    model_turn = 0
    for turn in turns:
        a, b = max(0, int(turn["start"])), min(n, int(turn["end"]))
        # the cells starting at the turn's positions (a cell never spans two turns: a turn
        # ends on a whole character)
        ca, cb = bisect_left(firsts, a), bisect_left(firsts, b)
        calls: list[CallView] = []
        for c in turn.get("calls") or []:
            if not isinstance(c, dict):
                continue
            result = None if c.get("result") is None else str(c["result"])
            calls.append(
                CallView(
                    name=str(c.get("name", "")),
                    arguments=_arguments_text(c.get("arguments")),
                    result=result,
                    result_json=None if result is None else result_json(result),
                )
            )
        view = TurnView(role=turn["role"], start=a, end=b, calls=calls, cells=cells[ca:cb])
        if turn["role"] == "model":
            view["number"] = model_turn
            state = states[model_turn] if model_turn < len(states) else None
            view["state"] = None if state is None else state_badge(str(state), turn=True)
            model_turn += 1
            view["sum_logprob"] = sum(logprobs[a:b]) if len(logprobs) >= b else None
            view["control_rows"] = [(label, row[ca:cb]) for label, row in rows]
            view["control_summary"] = control_summary(control, a, b)
        views.append(view)
    return views


def control_summary(
    control: Mapping[str, Sequence[float | None]], start: int, end: int
) -> list[tuple[str, str, int]]:
    """The one line a folded control-token table shows: per control token, its largest
    probability over positions [start, end) of a turn and the position it was at (first of
    ties); tokens with no probability there are left out."""
    out = []
    for token, probs in control.items():
        seen = [(p, i) for i in range(start, min(end, len(probs))) if (p := probs[i]) is not None]
        if seen:
            p, at = max(seen, key=lambda pi: (pi[0], -pi[1]))
            out.append((token, prob_text(p), at))
    return out


# --- what a mark on the step viewer means ----------------------------------------------------

# A tool result longer than this is shown as the text it is: parsing it is not worth the time
# (the recorder keeps 2,000 characters of one; longer is a hand-made record).
RESULT_PARSE_CHARS = 20_000


def result_json(text: str) -> str | None:
    """A tool result as pretty-printed JSON when it is a JSON object or array, or a Python
    literal dict or list (what TRL's `str()` of a tool's return value or of an error looks
    like: `{'error': ...}`); None otherwise (shown as the text it is). Read with json.loads and
    ast.literal_eval only, never eval: the result is untrusted text."""
    stripped = text.strip()
    if len(stripped) > RESULT_PARSE_CHARS or stripped[:1] not in ("{", "["):
        return None
    value: Any = None
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(stripped)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    if not isinstance(value, dict | list):
        return None
    try:
        return json.dumps(value, indent=2, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # a set, bytes, a tuple key: not JSON
        return None


# Structural states (vocab.FormatState, vocab.TurnState, and what a page says without one)
# → (tone, meaning). The tone colours the badge: ok green, warn amber, bad red, none grey.
STATES: dict[str, tuple[str, str]] = {
    "healthy_call": ("ok", "well-formed call(s) naming a listed tool, nothing else"),
    "text_pollution": ("warn", "a call with stray text around it, or naming an unknown tool"),
    "no_call": ("warn", "no call at all (an answer, or text)"),
    "collapse": ("bad", "the call structure broke: empty, unbalanced tags, cut off"),
    "open_call": ("bad", "a call left open: the turn was cut before its closing tag"),
    "eot_in_call": ("bad", "end-of-turn inside an open call"),
    "valid": ("ok", "format-valid (no structural state recorded)"),
    "invalid": ("bad", "not format-valid (no structural state recorded)"),
    "unchecked": ("none", "the importer did not check the format"),
    "not recorded": ("none", "no format_valid function was given: unknown, not invalid"),
}


def state_badge(state: str, *, turn: bool = False) -> dict[str, str]:
    """A structural state as a badge: its name, tone (STATES; unknown states grey) and meaning.
    A model turn without a call (`turn`) is how a tool-calling rollout answers: grey, not amber."""
    tone, meaning = STATES.get(state, ("none", "a state this dashboard does not know"))
    if turn and state == "no_call":
        tone, meaning = "none", "no call: the final answer, or text"
    return {"state": state, "tone": tone, "meaning": meaning}


def format_badge(
    format_valid: bool | None,
    format_state: str | None,
    meta: dict[str, Any] | None,
    max_calls: int | None = None,
) -> dict[str, Any]:
    """A rollout's format marks: its structural state as recorded (`format_state`; for a
    tool-calling rollout the whole rollout's, its worst turn's) coloured by what it means, and
    when the rollout is not format-valid although its state is fine, why (`problem`): a
    tool-calling rollout that never gave a final answer because it ended on a call, or
    simply not format-valid."""
    state = state_name(format_valid, format_state) or "not recorded"
    badge: dict[str, Any] = state_badge(state) | {"valid": format_valid, "problem": None}
    turns = _turn_list(meta or {})
    if format_valid is not False:
        return badge
    if turns is not None and (meta or {}).get("answer") is None:
        ran = sum(len(t.get("calls") or []) for t in turns if t["role"] == "tool")
        out = max_calls is not None and ran >= max_calls
        badge["problem"] = {
            "label": "ran out of calls" if out else "no final answer",
            "title": (
                f"no final answer: the rollout ended on a call after {ran} tool results, "
                f"the run's limit (max_calls {max_calls})"
                if out
                else "no final answer: the rollout ended on a tool call (the call limit or the "
                "length limit stopped it)"
            ),
        }
    elif badge["tone"] == "ok":
        badge["problem"] = {
            "label": "not format-valid",
            "title": "its structure is fine, but the run's format check failed it"
            + (" (a malformed call, or an answer out of format)" if turns is not None else ""),
        }
    return badge


def call_limit(config: dict[str, Any] | None) -> int | None:
    """How many tool calls a run let a rollout make: `max_calls` of a run launched here, else
    TRL's `max_tool_calling_iterations` in a recorded GRPOConfig; None when neither says."""
    for key in ("max_calls", "max_tool_calling_iterations"):
        value = (config or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


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
    turns = _turn_list(meta)
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


class GroupView(GroupHeader):
    """One group as the viewer shows it: its header and its rollouts' views."""

    rollouts: list[ShownRollout]


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
        views.append(GroupView(**group_header(members), rollouts=shown))
    return views


# --- groups overview: one row a group from the rollouts' scalar columns -----------------------

HEALTHY_STATE = "healthy_call"  # vocab.FormatState.healthy_call: a well-formed call
SPREAD_EPS = 1e-9  # rewards closer than this are equal (trainer.recorder.metrics.is_zero_std)


NO_CALL_STATE = "no_call"  # vocab.FormatState.no_call: no call at all


def broken(format_valid: bool | None, format_state: str | None) -> bool:
    """A broken call: the completion is not format-valid, or its structural state is recorded and
    is a call gone wrong. No call at all is broken only where the format says so: a run that
    never needs a tool (a user's single-turn task) answers with no call, and that is its format."""
    if format_valid is False:
        return True
    return format_state is not None and format_state not in (HEALTHY_STATE, NO_CALL_STATE)


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


@functools.lru_cache(maxsize=1 << 16)  # float16 probabilities: a few thousand distinct values
def prob_text(value: float | None, digits: int = 2) -> str:
    """A probability with fixed decimals; '<0.01' rather than a misleading 0.00."""
    if value is None or not math.isfinite(value):
        return "—"
    floor = 10 ** (-digits)
    return f"<{floor:.{digits}f}" if 0 < value < floor / 2 else f"{value:.{digits}f}"


def control_name(token: str) -> str:
    """A control token as text with its whitespace visible (tokentext.piece_text: 'Ġ<' → '·<'),
    for hover text (pages draw names with the `token` filter)."""
    return tokentext.piece_text(token).replace(" ", "·").replace("\n", "↵").replace("\t", "⇥")


def _cell_probability(probs: Sequence[float | None], first: int, last: int) -> float | None:
    """A cell's probability: the product of its tokens' (the chance of sampling its text once
    its first token's context was given); None when one is unknown."""
    p = 1.0
    for q in probs[first : last + 1]:
        if q is None:
            return None
        p *= q
    return p


def token_cells(
    spans: Sequence[tokentext.Cell],
    ids: Sequence[int],
    probs: Sequence[float | None],
    control: Mapping[str, Sequence[float | None]],
    sampled: Sequence[bool] | None,
    near_misses: Sequence[Sequence[str]],
    limit: int | None = None,
) -> Cells:
    """Per cell of a rollout's shown tokens (`spans`, those starting in the first `limit`
    positions): text, its positions (first, last), CSS classes and hover text (built here, not
    in Jinja: a 64-token completion × every control token is thousands of template
    operations). A cell of several tokens (one character split over them) shows the product of
    their probabilities, their ids, and the control tokens' probabilities at its first
    position."""
    cells = []
    names = {t: control_name(t) for t in control}
    heads = [(f"p({names[t]})=", ps) for t, ps in control.items()]  # a hover line each
    for span in spans:
        a, b = span.first, span.last
        if limit is not None and a >= limit:
            break
        if a == b:  # most cells: one token
            at, id_text, p, misses = f"#{a}", f"id {ids[a]}", probs[a], sorted(near_misses[a])
        else:
            at, id_text = f"#{a}–{b}", "ids " + ", ".join(map(str, ids[a : b + 1]))
            p = _cell_probability(probs, a, b)
            misses = sorted({t for i in range(a, b + 1) for t in near_misses[i]})
        if sampled is not None and not sampled[a]:
            title = f"{at} · {id_text} · tool result: not sampled, not trained"
            cells.append(
                TokenCell(text=span.text, first=a, last=b, cls="tok tool-tok", title=title)
            )
            continue
        lines = [f"{at} · {id_text} · p={prob_text(p, 3)}"]
        if b > a:
            each = " × ".join(prob_text(q, 3) for q in probs[a : b + 1])
            lines.append(f"one character over {b - a + 1} tokens: p is the product {each}")
        lines += [head + prob_text(ps[a], 3) for head, ps in heads]
        if misses:
            lines.append(f"near miss: {', '.join(names[t] for t in misses)} was likely here")
        cls = _CELL_CLASSES[probability_bin(p)][bool(misses)]
        cells.append(TokenCell(text=span.text, first=a, last=b, cls=cls, title="\n".join(lines)))
    return cells


# A token cell's CSS classes by its probability's shade (0-9) and whether it is a near miss.
_CELL_CLASSES = [(f"tok p{i}", f"tok p{i} near-miss") for i in range(10)]


def control_rows(
    spans: Sequence[tokentext.Cell],
    probs: Sequence[float | None],
    control: Mapping[str, Sequence[float | None]],
    limit: int | None = None,
) -> ControlRows:
    """The control-token table (the cells starting in its first `limit` positions): (row
    label, [(CSS class, text)] per cell). The sampled row is each cell's probability (the
    product of its tokens'); a control token's row its probability at the cell's first
    position."""
    shown = [s for s in spans if limit is None or s.first < limit]
    sampled = [_cell_probability(probs, s.first, s.last) for s in shown]
    rows = [("sampled", [(f"p{probability_bin(p)}", prob_text(p)) for p in sampled])]
    for token, ps in control.items():
        firsts = [ps[s.first] for s in shown]
        rows.append((token, [(f"c{probability_bin(p)}", prob_text(p)) for p in firsts]))
    return rows


def page_token_limit(rollouts: int) -> int:
    """Token cells per rollout on one page: PAGE_TOKENS shared by the group's rollouts (a tab
    panel each), never fewer than MIN_PAGE_TOKENS."""
    return max(MIN_PAGE_TOKENS, PAGE_TOKENS // max(rollouts, 1))
