"""A run's call tags, and where they stand in a completion's tokens: one token or several.

A real chat model's tokenizer rarely holds a task's tags as single tokens: SmolLM2 reads
`<tool>` as `<`, `tool`, `>`. So tags are found in the decoded text, and each is placed on the
tokens that make it up through the bytes every token contributes (byte-level BPE's byte alphabet
mapped back, SentencePiece's `▁` and `<0xNN>` pieces, added tokens as their text). A tag's
control-token probability is read at its first token: the token that starts the tag when a
reply starts with it (`<` for `<tool>`), which is the token that stands for the tag on the pages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rollout_lens.server.core import tokentext
from rollout_lens.server.core.distinct import distinct
from rollout_lens.trainer.recorder.structure import ESCALATION_TAGS

# The common tool-call formats, tried in this order when the run names none and the chat
# template declares none: Qwen/Hermes-style, then the Escalation task's reply format.
COMMON_TAGS = (("<tool_call>", "</tool_call>"), ESCALATION_TAGS)
_TEMPLATE_TAG = re.compile(r"<(tool_call|function_call|functioncall|tool)>")


@dataclass(frozen=True)
class CallTags:
    """A call format, and the token that stands for each tag (its first token)."""

    open: str
    close: str
    open_token: str
    close_token: str

    @property
    def pair(self) -> tuple[str, str]:
        return (self.open, self.close)

    @property
    def single_tokens(self) -> bool:
        """Whether each tag is one token of the tokenizer (its own token stands for it)."""
        return self.open_token == self.open and self.close_token == self.close

    @property
    def spelled(self) -> bool:
        """Whether the tokenizer can spell the tags at all (else no token stands for them)."""
        return bool(self.open_token and self.close_token)


def template_tags(tokenizer: Any) -> tuple[str, str] | None:
    """The call tags the model's chat template declares for tools, where it declares any (Qwen's
    and Hermes' templates write `<tool_call>` … `</tool_call>` around each call)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tool" not in template:
        return None
    for name in _TEMPLATE_TAG.findall(template):
        if f"</{name}>" in template:
            return (f"<{name}>", f"</{name}>")
    return None


def first_token(tokenizer: Any, tag: str) -> str | None:
    """The token a reply starting with `tag` starts with (the tag itself when it is a token);
    None when the tokenizer cannot spell the tag (its tokens do not decode back to it)."""
    if tag in tokenizer.get_vocab():
        return tag
    ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
    if not ids or tokenizer.decode(ids, skip_special_tokens=False) != tag:
        return None
    return str(tokenizer.convert_ids_to_tokens(ids[0]))


def call_tags(tokenizer: Any, requested: tuple[str, str] | None = None) -> list[CallTags]:
    """The call formats a run's completions are read with, in order: the one the run names,
    else the chat template's, then the common ones that the tokenizer can spell (a completion
    is read with the first whose tags it holds); none when it can spell none of them."""
    if requested is not None:
        pairs = [requested]
    else:
        declared = template_tags(tokenizer)
        pairs = list(dict.fromkeys([*([declared] if declared else []), *COMMON_TAGS]))
    out = []
    for o, c in pairs:
        first = first_token(tokenizer, o), first_token(tokenizer, c)
        if first[0] is not None and first[1] is not None:
            out.append(CallTags(o, c, first[0], first[1]))
        elif requested is not None:  # read in the text all the same; the model cannot say it
            out.append(CallTags(o, c, "", ""))
    return out  # empty: no tag is known (no structural states)


def pick(formats: Sequence[CallTags], text: str) -> CallTags:
    """The format of `formats` a completion's text uses: the first whose tags it holds."""
    for found in formats:
        if found.open in text or found.close in text:
            return found
    return formats[0]


# --- tokens → bytes → where a text's marks stand ----------------------------------------------------


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The kinds of the fast tokenizer's decoder and its parts (ByteLevel, Metaspace, …)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    text = repr(decoder)
    return {k for k in ("ByteLevel", "Metaspace", "Replace") if k in text}


class TokenPieces:
    """convert_ids_to_tokens of one tokenizer, read from a table of every id's piece made on
    first use: a completion's pieces are one look-up of its ids, where convert_ids_to_tokens is
    a Python loop (about 1 µs a token: half a second of the writer's thread, holding the GIL,
    at 512 rollouts × 1,000 tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._table: np.ndarray | None = None

    def of(self, found: np.ndarray, ids: list[int]) -> list[str]:
        """convert_ids_to_tokens(ids) (`found`: the same ids as an array); an id past the table
        (a model whose embeddings outnumber its tokenizer's ids) is converted as before."""
        if self._table is None:
            try:
                every = list(self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer)))))
            except TypeError:  # no len(): every completion converted as it comes
                every = []
            self._table = np.empty(len(every), dtype=object)
            self._table[:] = every
        table = self._table
        if len(found) and (int(found.min()) < 0 or int(found.max()) >= len(table)):
            return list(self.tokenizer.convert_ids_to_tokens(ids))
        return list(table[found].tolist())


MAX_TABLE_IDS = 1 << 20  # TokenBytes' table holds ids below this (vocabularies are a few 100,000)


class TokenBytes:
    """The bytes each token id of one tokenizer contributes to its decoded text, by the
    tokenizer's decoder (server.core.tokentext's rules, as the pages read the stored pieces),
    from the ids' pieces (`pieces`: the preparer's table, shared; made here when not given)."""

    def __init__(self, tokenizer: Any, pieces: TokenPieces | None = None) -> None:
        self.tokenizer = tokenizer
        self.pieces = pieces if pieces is not None else TokenPieces(tokenizer)
        kinds = _decoder_kinds(tokenizer)
        if "ByteLevel" in kinds:
            self.rule = tokentext.BYTE_LEVEL
        elif kinds & {"Metaspace", "Replace"}:
            self.rule = tokentext.SENTENCEPIECE
        else:
            self.rule = tokentext.JOIN
        self.added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        # by id: whether its bytes are known, its bytes and their length (grown as ids come):
        # a completion's layout is then a look-up of its ids, not a Python call a token
        self._known = np.zeros(0, dtype=bool)
        self._bytes = np.empty(0, dtype=object)
        self._lengths = np.zeros(0, dtype=np.int64)
        self._other: dict[int, bytes] = {}  # negative or huge ids, as they come

    def _of(self, token_id: int) -> bytes:
        """One id's bytes, kept apart from the table (an id it cannot hold)."""
        found = self._other.get(token_id)
        if found is None:
            piece = self.pieces.of(np.array([token_id]), [token_id])[0]
            found = self._other[token_id] = self._compute(token_id, piece)
        return found

    def _compute(self, token_id: int, piece: str) -> bytes:
        piece = str(piece)
        if token_id in self.added:  # an added token decodes as its own text
            return piece.encode("utf-8", "surrogatepass")
        return tokentext.piece_bytes(piece, self.rule)

    def _table(self, ids: np.ndarray) -> bool:
        """Learn the bytes of `ids` not known yet; False where an id cannot be held (negative,
        or past MAX_TABLE_IDS)."""
        if not len(ids):
            return True
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= MAX_TABLE_IDS:
            return False
        if high >= len(self._known):
            size = max(high + 1, 2 * len(self._known), 1 << 16)
            known, table, lengths = (
                np.zeros(size, dtype=bool),
                np.empty(size, dtype=object),
                np.zeros(size, dtype=np.int64),
            )
            n = len(self._known)
            known[:n], table[:n], lengths[:n] = self._known, self._bytes, self._lengths
            self._known, self._bytes, self._lengths = known, table, lengths
        new = distinct(ids[~self._known[ids]])
        new_ids = new.tolist()
        for token_id, piece in zip(new_ids, self.pieces.of(new, new_ids), strict=True):
            found = self._compute(token_id, piece)
            self._bytes[token_id], self._lengths[token_id] = found, len(found)
            self._known[token_id] = True
        return True

    def layout(self, ids: Sequence[int], text: str) -> tuple[bytes, np.ndarray] | None:
        """The bytes the tokens make and each token's end in them, when they give `text` back
        (its decoded text, special tokens kept); None when they do not (then no position can
        be trusted). A leading space that decoding strips (SentencePiece) is left out."""
        found = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self._table(found):
            joined = b"".join(self._bytes[found].tolist())
            ends = np.cumsum(self._lengths[found])
        else:
            pieces = [self._of(i) for i in found.tolist()]
            joined = b"".join(pieces)
            ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
        if joined.startswith(b" ") and not text.startswith(" "):
            joined, ends = joined[1:], np.maximum(ends - 1, 0)
        if joined.decode("utf-8", "replace") != text:
            return None
        return joined, ends


@dataclass(frozen=True)
class Marks:
    """Where one completion's call tags and end-of-turn tokens stand, as token positions: each
    tag as [first token, one past its last token), end-of-turn as its token's position."""

    n: int
    opens: tuple[tuple[int, int], ...] = ()
    closes: tuple[tuple[int, int], ...] = ()
    eots: tuple[int, ...] = ()

    def within(self, start: int, end: int) -> Marks:
        """The marks inside positions [start, end), counted from `start` (one model turn)."""

        def inside(spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
            return tuple((a - start, b - start) for a, b in spans if start <= a and b <= end)

        return Marks(
            n=end - start,
            opens=inside(self.opens),
            closes=inside(self.closes),
            eots=tuple(p - start for p in self.eots if start <= p < end),
        )


def single_token_marks(tokens: Sequence[str], open_tag: str, close_tag: str, eot: str) -> Marks:
    """Marks of tags that are single tokens, by the tokens' own texts."""
    return Marks(
        n=len(tokens),
        opens=tuple((i, i + 1) for i, t in enumerate(tokens) if t == open_tag),
        closes=tuple((i, i + 1) for i, t in enumerate(tokens) if t == close_tag),
        eots=tuple(i for i, t in enumerate(tokens) if t == eot),
    )


def find_marks(data: bytes, ends: np.ndarray, tags: CallTags, eot: str | None) -> Marks:
    """The marks in a completion's bytes (TokenBytes.layout), placed on its tokens by `ends`."""

    def spans(mark: str) -> tuple[tuple[int, int], ...]:
        needle = mark.encode("utf-8")
        out = []
        at = data.find(needle)
        while at >= 0:
            first = int(np.searchsorted(ends, at, side="right"))
            last = int(np.searchsorted(ends, at + len(needle) - 1, side="right"))
            out.append((first, last + 1))
            at = data.find(needle, at + len(needle))
        return tuple(out)

    return Marks(
        n=len(ends),
        opens=spans(tags.open),
        closes=spans(tags.close),
        eots=tuple(a for a, _ in spans(eot)) if eot else (),
    )
