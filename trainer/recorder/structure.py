"""Structural state of a completion: is the tool call intact, polluted, collapsed or absent?

One reading for every kind of run (the table of states in docs/recording/trl.md): the call tags
and end-of-turn tokens of a text are scanned left to right, so a tag is found whether the
tokenizer holds it as one token or several, and the state follows from what the scan saw:

- collapse: nothing but end-of-turn tokens and space; or a call left open (cut by the length
  limit inside it, or never closed); or end-of-turn inside an open call;
- no call: text with no call tag at all;
- healthy call: closed calls and nothing else (the single-turn Escalation task: exactly one,
  naming a listed id);
- text pollution: everything else with a tag: text around a call, a stray closing tag, a second
  opening tag inside a call, an id the prompt did not list.

Being cut by the length limit is not a state of its own: a complete call followed by text that
the limit cut is a polluted call, not a collapse.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from rollout_lens.server.core.vocab import FormatState

__all__ = ["ESCALATION_TAGS", "FormatState", "TagReading", "classify", "read_tags"]

ESCALATION_TAGS = ("<tool>", "</tool>")  # the Escalation task's reply format


@dataclass(frozen=True)
class TagReading:
    """What a left-to-right scan of a text's call tags and end-of-turn tokens found."""

    tags: int  # call tags seen (opening and closing)
    calls: tuple[str, ...]  # the content of each call opened and closed, in order
    left_open: bool  # an opening tag never closed: cut inside a call, or the text ended there
    eot_in_call: bool  # an end-of-turn token inside an open call
    stray: bool  # a closing tag with no open call, or an opening tag inside an open call
    outside: str  # the text outside closed calls, end-of-turn tokens left out

    @property
    def only_calls(self) -> bool:
        """Closed calls and nothing else (space aside)."""
        return bool(self.calls) and not self.stray and not self.outside.strip()


@functools.cache
def _pattern(open_tag: str, close_tag: str, ends: tuple[str, ...]) -> re.Pattern[str]:
    marks = sorted({open_tag, close_tag, *ends}, key=len, reverse=True)  # longest first
    return re.compile("|".join(re.escape(m) for m in marks if m))


def read_tags(text: str, tags: tuple[str, str], end_tokens: Sequence[str] = ()) -> TagReading:
    """Scan `text` (decoded with its special tokens) for the call tags and end-of-turn tokens."""
    open_tag, close_tag = tags
    ends = tuple(t for t in end_tokens if t and t not in tags)
    count = 0
    calls: list[str] = []
    outside: list[str] = []
    opened_at: int | None = None  # where the open call's content starts
    eot_in_call = stray = False
    last = 0  # end of the previous mark
    for match in _pattern(open_tag, close_tag, ends).finditer(text):
        mark = match.group()
        if opened_at is None:
            outside.append(text[last : match.start()])
        if mark == open_tag:
            count += 1
            if opened_at is not None:
                stray = True  # opened again inside a call: the first one never closed
            opened_at = match.end()
        elif mark == close_tag:
            count += 1
            if opened_at is None:
                stray = True
                outside.append(mark)
            else:
                calls.append(text[opened_at : match.start()])
                opened_at = None
        elif opened_at is not None:  # end-of-turn
            eot_in_call = True
        last = match.end()
    if opened_at is None:
        outside.append(text[last:])
    return TagReading(
        tags=count,
        calls=tuple(calls),
        left_open=opened_at is not None,
        eot_in_call=eot_in_call,
        stray=stray,
        outside="".join(outside),
    )


def classify(
    completion: str, listed_ids: Collection[str], *, tags: tuple[str, str] = ESCALATION_TAGS
) -> FormatState:
    """The structural state of one single-turn Escalation reply (pure: table-tested): a healthy
    call is exactly one call, naming a listed id, and nothing else."""
    if not completion.strip():
        return FormatState.collapse
    found = read_tags(completion, tags)
    if found.tags == 0:
        return FormatState.no_call
    if found.left_open or found.eot_in_call:
        return FormatState.collapse
    if found.only_calls and len(found.calls) == 1 and found.calls[0].strip() in listed_ids:
        return FormatState.healthy_call
    return FormatState.text_pollution
