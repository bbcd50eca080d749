"""A step's search words found in one numpy pass over its texts' code points, not a regex match
and a str object a word.

search.words is the rule: the runs of letters and digits (Python's `[^\\W_]`: a character is in
a word when str.isalnum says so) of a text's first SEARCH_CHARS characters, lower-cased. `spaced`
gives each text with every other character replaced by a space, so that its words are the
runs between spaces: SQLite's FTS5 reads them there in C (its contentless, detail=none index
holds which words a row has, not how often, so the repeats cost it nothing), and str.split
hands PostgreSQL's numbering the same words. At 512 rollouts × 1,000 tokens a step, finding
each text's words with findall and keeping each once was about half of the writer's time
holding the GIL (bench.scale --profile).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

_UNICODE = 0x110000
_SPACE = 0x20
_lock = threading.Lock()
_word_chars: np.ndarray | None = None


def word_chars() -> np.ndarray:
    """Code point → whether it is in a word (str.isalnum, as `[^\\W_]` reads it), built once."""
    global _word_chars
    with _lock:
        if _word_chars is None:
            table = np.zeros(_UNICODE, dtype=bool)
            table[[c for c in range(_UNICODE) if chr(c).isalnum()]] = True
            _word_chars = table
    return _word_chars


def spaced(texts: Sequence[str], limit: int) -> list[str]:
    """Each text's first `limit` characters lower-cased, every character that is in no word a
    space: `re.findall(r"[^\\W_]+", text[:limit].lower())` is its `.split()`."""
    cut = [t[:limit] for t in texts]
    out = [""] * len(cut)
    ascii_ = [i for i, t in enumerate(cut) if t.isascii()]  # isascii reads a flag: no scan
    others = [i for i, t in enumerate(cut) if not t.isascii()]
    for at, found in ((ascii_, _ascii_spaced), (others, _unicode_spaced)):
        for i, text_ in zip(at, found([cut[i] for i in at]), strict=True):
            out[i] = text_
    return out


def _apart(joined: str, texts: list[str]) -> list[str]:
    """`joined`, the texts' same-length images end to end, cut back into one a text."""
    ends = list(accumulate(len(t) for t in texts))
    return [joined[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


# ASCII: letters lower-cased and digits kept, every other byte a space (one bytes.translate)
_ASCII = bytes(
    b if chr(b).isdigit() or chr(b).islower() else b + 32 if chr(b).isupper() else _SPACE
    for b in range(128)
) + bytes([_SPACE] * 128)


def _ascii_spaced(texts: list[str]) -> list[str]:
    if not texts:
        return []
    return _apart("".join(texts).encode("ascii").translate(_ASCII).decode("ascii"), texts)


def _unicode_spaced(texts: list[str]) -> list[str]:
    """Lower-cased (str.lower: a character may become two), then each code point looked up."""
    if not texts:
        return []
    lowered = [t.lower() for t in texts]
    joined = "".join(lowered)
    try:
        raw = joined.encode("utf-32-le")
    except UnicodeEncodeError:  # a lone surrogate: no letter, a space like any separator
        raw = joined.encode("utf-32-le", "surrogatepass")
    points = np.frombuffer(raw, dtype="<u4")
    kept = np.where(word_chars()[points], points, np.uint32(_SPACE)).astype("<u4", copy=False)
    return _apart(kept.tobytes().decode("utf-32-le"), lowered)
