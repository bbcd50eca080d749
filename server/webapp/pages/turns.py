"""A tool-calling rollout as a conversation (turn_views): per model turn its token cells,
control-token rows and Σ logprob; per tool stretch each call and its result."""

from __future__ import annotations

import ast
import json
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any, NotRequired

from rollout_lens.server.webapp.pages.badges import state_badge
from rollout_lens.server.webapp.pages.cells import Cells, ControlRows, prob_text
from rollout_lens.server.webapp.queries.group_header import turn_list
from typing_extensions import TypedDict


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
    turns = turn_list(meta)
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
