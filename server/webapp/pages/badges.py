"""What a mark on the step viewer means: a structural state as a badge, a rollout's format
marks, a run's call limit."""

from __future__ import annotations

from typing import Any

from rollout_lens.server.webapp.queries.group_header import turn_list
from rollout_lens.server.webapp.queries.overview import state_name

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
    turns = turn_list(meta or {})
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
