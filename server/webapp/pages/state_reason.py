"""Why a rollout has its structural state, in words to show beside its badge.

The recorder's rule (trainer/recorder/structure.py) calls a single clean call of a tool the
prompt does not list `text_pollution`, as it does stray text around a call; the completion tells
the two apart, and the reader should not have to open the key to learn which it was.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rollout_lens.server.webapp.pages.badges import STATES

# One call and nothing else: the single-turn reply format, in either tag pair the recorder reads.
_ONE_CALL = re.compile(r"<(tool|tool_call)>\s*([^<>\s]*)\s*</\1>")
_CALL_TAGS = frozenset({"<tool>", "</tool>", "<tool_call>", "</tool_call>"})


def state_reason(state: str, completion: str | None, control_tokens: Sequence[str] = ()) -> str:
    """The reason for `state`: for text pollution which kind; for another bad state its meaning;
    "" for a healthy one (the badge says enough)."""
    tone, meaning = STATES.get(state, ("none", ""))
    if state == "text_pollution" and completion is not None:
        text = completion.strip()
        for token in control_tokens:  # an end-of-turn token's text may close the completion
            if token and token not in _CALL_TAGS and text.endswith(token):
                text = text[: -len(token)].rstrip()
        call = _ONE_CALL.fullmatch(text)
        if call:
            return f"names {call.group(2) or 'no tool'}, which the prompt does not list"
        return "stray text around the call" if _ONE_CALL.search(text) else meaning
    return meaning if tone in ("warn", "bad") else ""
