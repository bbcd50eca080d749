"""What one page shows of a rollout: a completion of a million characters (or tokens) must not
make the step viewer slow or huge. The JSON twin has everything; pages say what they cut."""

from __future__ import annotations

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


def page_token_limit(rollouts: int) -> int:
    """Token cells per rollout on one page: PAGE_TOKENS shared by the group's rollouts (a tab
    panel each), never fewer than MIN_PAGE_TOKENS."""
    return max(MIN_PAGE_TOKENS, PAGE_TOKENS // max(rollouts, 1))
