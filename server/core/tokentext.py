"""What a token reads as: a tokenizer's raw pieces (byte-level BPE's 'Ġcan' and 'Ċ', SentencePiece's
'▁can' and byte fallback '<0xE3>') → the bytes each contributes → the text a streaming detokenizer
shows for it.

The run's token table keeps the raw pieces (exact, and what TEXT_RULES rebuild a completion
from); pages, JSON answers and exports show these texts instead. A piece may carry part of a UTF-8
character (a Japanese character or an emoji split over tokens): `token_texts` gives it "" and the
token that completes the character the whole character, so the texts join to the decoded text
with one entry per id; `cells` merges such runs into one cell for a page.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Sequence
from functools import cache
from itertools import repeat
from typing import Any, NamedTuple

# How pieces become text (the ids of TEXT_RULES; a stored text_rule adds 8 × the trailing tokens
# its completion text leaves out, which a token's own text never does).
JOIN, BYTE_LEVEL, SENTENCEPIECE, SENTENCEPIECE_STRIPPED = 1, 2, 3, 4


@cache
def byte_level_table() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet (bytes_to_unicode) inverted, as a str.translate table:
    character → the one-byte (latin-1) character of the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {c: chr(b) for b, c in zip(printable, chars, strict=True)}


# The characters bytes_to_unicode moved (space → 'Ġ', newline → 'Ċ', …): U+0100–U+0143. A piece
# holding one is byte-level BPE's; one holding a character outside the alphabet is not.
_REMAPPED = re.compile("[\u0100-\u0143]")
_OUTSIDE_BYTE_LEVEL = re.compile("[^!-~\u00a1-\u00ac\u00ae-\u00ff\u0100-\u0143]")
_SENTENCEPIECE_MARK = re.compile("\u2581|<0x[0-9A-Fa-f]{2}>")
_HEX = frozenset("0123456789abcdefABCDEF")


def _byte_fallback(piece: str) -> int | None:
    """The byte of a SentencePiece byte-fallback piece ('<0x0A>'), else None."""
    if (
        len(piece) == 6
        and piece.startswith("<0x")
        and piece[5] == ">"
        and _HEX.issuperset(piece[3:5])
    ):
        return int(piece[3:5], 16)
    return None


def _byte_level_bytes(piece: str) -> bytes:
    """A byte-level piece's bytes; a piece with characters outside the alphabet (an added or
    special token, such as '<think> ') is its own UTF-8 text, as tokenizers decode it."""
    if _OUTSIDE_BYTE_LEVEL.search(piece) is None:
        return piece.translate(byte_level_table()).encode("latin-1")
    return piece.encode("utf-8", "surrogatepass")


def _sentencepiece_bytes(piece: str) -> bytes:
    byte = _byte_fallback(piece)
    if byte is not None:
        return bytes((byte,))
    return piece.replace("\u2581", " ").encode("utf-8", "surrogatepass")


def _utf8(piece: str) -> bytes:
    return piece.encode("utf-8", "surrogatepass")


_BYTES: dict[int, Callable[[str], bytes]] = {
    JOIN: _utf8,
    BYTE_LEVEL: _byte_level_bytes,
    SENTENCEPIECE: _sentencepiece_bytes,
    SENTENCEPIECE_STRIPPED: _sentencepiece_bytes,
}


def _base_rule(rule: int) -> int:
    """A stored text_rule (id + 8 × dropped tokens) → the rule id its pieces read by."""
    base = rule % 8
    if base not in _BYTES:
        raise ValueError(f"unknown text rule {rule}")
    return base


def piece_bytes(piece: str, rule: int) -> bytes:
    """The exact bytes a piece contributes to the decoded text under `rule` (byte-level: the
    inverse of bytes_to_unicode; SentencePiece: '▁' a space, '<0xNN>' that byte)."""
    return _BYTES[_base_rule(rule)](piece)


# --- the rules that rebuild a completion from its pieces (server.store.arrays.TEXT_RULES) ------


def _join(pieces: Sequence[str]) -> str:
    return "".join(pieces)


def _byte_level(pieces: Sequence[str]) -> str:
    """Byte-level BPE tokens (Qwen, Llama 3, GPT-2: 'Ġword', 'Ċ') → the text they encode (bytes
    that are not UTF-8 raise: then this is not the rule)."""
    joined = "".join(pieces)
    if _OUTSIDE_BYTE_LEVEL.search(joined) is None:  # the usual case: one translate, in C
        return joined.translate(byte_level_table()).encode("latin-1").decode("utf-8")
    return b"".join(map(_byte_level_bytes, pieces)).decode("utf-8")


def _sentencepiece(pieces: Sequence[str]) -> str:
    """SentencePiece tokens ('▁word', '<0x0A>') → text, the leading space kept."""
    return b"".join(map(_sentencepiece_bytes, pieces)).decode("utf-8")


def _sentencepiece_stripped(pieces: Sequence[str]) -> str:
    text = _sentencepiece(pieces)
    return text[1:] if text.startswith(" ") else text


# rule id → how token pieces become text. A rule also says how many trailing tokens the text
# leaves out (a special end-of-turn token that decoding skips): text_rule = id + 8 × dropped.
TEXT_RULES: dict[int, Callable[[Sequence[str]], str]] = {
    JOIN: _join,
    BYTE_LEVEL: _byte_level,
    SENTENCEPIECE: _sentencepiece,
    SENTENCEPIECE_STRIPPED: _sentencepiece_stripped,
}


# --- each token's text ---------------------------------------------------------------------------


# piece → its text when its bytes are whole characters, else None; per rule. A vocabulary's pieces
# are decoded once, then looked up (a dict in C: a step of 512 × 1,024 tokens is 0.5 M lookups).
_KNOWN: dict[int, dict[str, str | None]] = {rule: {} for rule in _BYTES if rule != JOIN}
_KNOWN_MAX = 1 << 18  # pieces a rule keeps (a vocabulary is ~50k–250k): then it starts again
_UNSEEN: Any = object()


def _decoded(piece: str, convert: Callable[[str], bytes]) -> str | None:
    try:
        return convert(piece).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _whole_texts(pieces: Sequence[str], base: int) -> list[str | None]:
    """Each piece's text when its bytes are whole characters, else None."""
    known = _KNOWN[base]
    texts = list(map(known.get, pieces, repeat(_UNSEEN)))
    if _UNSEEN in texts:
        new = set(pieces).difference(known)
        if len(known) + len(new) > _KNOWN_MAX:
            known.clear()
        convert = _BYTES[base]
        known.update((piece, _decoded(piece, convert)) for piece in new)
        # a piece another thread's clear just dropped reads None: the slow path, still exact
        texts = list(map(known.get, pieces))
    return texts


def _strip_first_space(texts: list[str]) -> list[str]:
    """Rule 4: the decoded text's leading space left out (the first token with any text)."""
    for i, text in enumerate(texts):
        if text:
            if text.startswith(" "):
                texts[i] = text[1:]
            break
    return texts


def _streamed(
    pieces: Sequence[str], whole: list[str | None], rule: int, final: bool
) -> tuple[list[str], list[bool]]:
    """Each piece's text as an incremental UTF-8 decoder gives it (invalid bytes → U+FFFD, as
    tokenizers' decode writes them), and after each piece whether a character is left open.

    `whole` is _whole_texts's answer: only the runs from a piece that is part of a character
    to where no character is open and the next piece is whole again go through the decoder
    (a whole piece fed with nothing open gives its own text), so the cost is in those pieces."""
    convert = _BYTES[rule]
    texts: list[Any] = list(whole)
    open_after = [False] * len(pieces)
    n, i = len(pieces), 0
    while True:
        try:
            i = texts.index(None, i)
        except ValueError:
            break
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while i < n:
            texts[i] = decoder.decode(convert(pieces[i]))
            open_after[i] = still_open = bool(decoder.getstate()[0])
            i += 1
            if not still_open and (i == n or whole[i] is not None):
                break
        if i == n and final:
            texts[-1] += decoder.decode(b"", final=True)  # a character cut by the end: U+FFFD
    return texts, open_after


def token_texts(pieces: Sequence[str], rule: int, *, final: bool = True) -> list[str]:
    """Each token's text as a streaming detokenizer shows it: "".join(result) is the decoded
    text (special tokens as their text), one entry per piece. A token that ends inside a UTF-8
    character gives "", the one that completes it the character. `final=False` for a window of
    a longer completion: a character its last pieces leave open is not closed with U+FFFD."""
    base = _base_rule(rule)
    if base == JOIN:
        return list(pieces)
    whole = _whole_texts(pieces, base)
    # some piece carries part of a character (Japanese, emoji): those runs are streamed
    out: list[str] = _streamed(pieces, whole, base, final)[0] if None in whole else whole  # type: ignore[assignment]
    return _strip_first_space(out) if base == SENTENCEPIECE_STRIPPED else out


class Cell(NamedTuple):
    """A page's cell: the text of tokens first…last (several when they share a character)."""

    text: str
    first: int
    last: int


def cells(pieces: Sequence[str], rule: int, *, final: bool = True) -> list[Cell]:
    """The tokens as a page shows them: one cell per token, except that a run of tokens carrying
    parts of one UTF-8 character is one cell (' 🎉' from 'ĠðŁ', 'İ', 'ī' covers three ids)."""
    base = _base_rule(rule)
    texts: list[str | None] = list(pieces) if base == JOIN else _whole_texts(pieces, base)
    if None not in texts:
        whole: list[str] = texts  # type: ignore[assignment]
        if base == SENTENCEPIECE_STRIPPED:
            _strip_first_space(whole)
        return [Cell(text, i, i) for i, text in enumerate(whole)]
    streamed, open_after = _streamed(pieces, texts, base, final)
    if base == SENTENCEPIECE_STRIPPED:
        _strip_first_space(streamed)
    out: list[Cell] = []
    first = 0
    for i, still_open in enumerate(open_after):
        if not still_open or i == len(open_after) - 1:
            out.append(Cell("".join(streamed[first : i + 1]), first, i))
            first = i + 1
    return out


# --- which rule a stored rollout's pieces read by ------------------------------------------------


def infer_rule(pieces: Sequence[str]) -> int:
    """The rule a tokenizer's pieces read by, from the pieces alone (a rollout whose completion
    text was stored, so no rule was recorded): byte-level when a piece uses the characters
    bytes_to_unicode moved and every piece that is not a tag (`<…>`) is in its alphabet;
    SentencePiece (its decoders strip the leading space) when a piece uses '▁' or '<0xNN>';
    else the pieces are their own text."""
    joined = "".join(pieces)
    if _REMAPPED.search(joined) and (
        _OUTSIDE_BYTE_LEVEL.search(joined) is None
        or all(
            _OUTSIDE_BYTE_LEVEL.search(p) is None or (p.startswith("<") and p.endswith(">"))
            for p in pieces
        )
    ):
        return BYTE_LEVEL
    if _SENTENCEPIECE_MARK.search(joined):
        return SENTENCEPIECE_STRIPPED
    return JOIN


def rule_for(stored_rule: int | None, pieces: Sequence[str]) -> int:
    """The rule a stored rollout's pieces read by: the one that rebuilt its completion (its
    text_rule), else the one its pieces show (infer_rule)."""
    return _base_rule(stored_rule) if stored_rule is not None else infer_rule(pieces)


def piece_text(piece: str) -> str:
    """One piece alone as text (a control token's name, 'Ġ<' → ' <'), by the rule it shows;
    a piece that is part of a character reads as its bytes' replacement character."""
    rule = infer_rule([piece])
    return piece_bytes(piece, rule).decode("utf-8", "replace")


def matching_rule(pieces: Sequence[str], texts: Sequence[str]) -> int:
    """The rule by which `texts` were read from `pieces` (token_texts, as a rollout's `tokens`
    from its `token_pieces`): the one the pieces show, else the first that gives them (a
    window's last text may end with the U+FFFD of a character the end cut)."""
    shown = infer_rule(pieces)
    for rule in (shown, BYTE_LEVEL, SENTENCEPIECE_STRIPPED, SENTENCEPIECE, JOIN):
        got = token_texts(pieces, rule, final=False)
        if len(got) == len(texts) and (
            not got or (got[:-1] == list(texts[:-1]) and texts[-1].startswith(got[-1]))
        ):
            return rule
    return shown
