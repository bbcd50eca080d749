"""Structural state of a completion: is the tool call intact, polluted, collapsed or absent?"""

from __future__ import annotations

import re
from collections.abc import Collection

from rollout_lens.server.core.vocab import FormatState

__all__ = ["FormatState", "classify"]

_CALL = re.compile(r"<tool>\s*([^<>\s]*)\s*</tool>")


def classify(
    completion: str, listed_ids: Collection[str], *, truncated: bool = False
) -> FormatState:
    """The structural state of one completion (pure: table-tested)."""
    text = completion.strip()
    opens, closes = text.count("<tool>"), text.count("</tool>")
    if not text or truncated or opens != closes or (opens and text == "<tool>"):
        return FormatState.collapse
    if opens == 0:
        return FormatState.no_call
    calls = _CALL.findall(text)
    if len(calls) != opens:
        return FormatState.collapse  # tags present but not nested as <tool>ID</tool>
    if len(calls) == 1 and _CALL.fullmatch(text) and calls[0] in listed_ids:
        return FormatState.healthy_call
    return FormatState.text_pollution
