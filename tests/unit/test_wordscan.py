"""server.store.wordscan finds a step's search words in one pass: the same words, in the same
order, as Python's regex over each lower-cased text (search.words' rule), on ASCII and on every
kind of character that makes str.lower or \\w differ from a byte's view."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from rollout_lens.server.store import search, wordscan

# characters where lower-casing or word membership is not one code point to one: ẞ, İ (two
# characters lower-cased), final sigma, titlecase digraphs, combining marks (no letters),
# private use (no letter), other scripts' digits and numbers, `_` and NUL (separators), a lone
# surrogate, astral letters and symbols
TRICKY = "ßẞİıΣσςǅǄǆ\u0307\u0301\ue000\U0001f600\U0001d400٣२Ⅻ½²_\x00\ud800é한字"
ASCII = "".join(chr(i) for i in range(128))


def _oracle(text: str, limit: int) -> list[str]:
    return re.findall(r"[^\W_]+", text[:limit].lower())


def _texts(rng: random.Random) -> list[str]:
    anything = TRICKY + "".join(chr(rng.randrange(0x110000)) for _ in range(64))
    return [
        "".join(rng.choice(anything if mixed else ASCII) for _ in range(rng.randrange(0, 80)))
        for mixed in (rng.random() < 0.5 for _ in range(rng.randrange(0, 7)))
    ]


@pytest.mark.parametrize("seed", range(4))
def test_spaced_texts_split_into_the_regex_words(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        texts = _texts(rng)
        limit = rng.choice([1, 7, 30, search.SEARCH_CHARS])
        found = wordscan.spaced(texts, limit)
        assert [f.split() for f in found] == [_oracle(t, limit) for t in texts], texts


def test_words_are_spaced_words_kept_once() -> None:
    text_ = "Straße, STRASSE und Über-Weg: über_weg İstanbul ǅemal x1y2 x1y2 ΣΟΦΟΣ"
    (found,) = search.spaced([text_])
    assert " ".join(dict.fromkeys(found.split())) == search.words(text_)
    assert found.split() == ["straße", "strasse", "und", "über", "weg", "über", "weg"] + [
        "i",
        "stanbul",
        "ǆemal",
        "x1y2",
        "x1y2",
        "σοφος",
    ]


def test_the_first_search_chars_only() -> None:
    text_ = "a" * (search.SEARCH_CHARS - 2) + " bc" + " late"
    (found,) = search.spaced([text_])
    assert found.split() == ["a" * (search.SEARCH_CHARS - 2), "b"]


class _Numbering(search.WordNumbers):
    """Word numbers drawn here, in the order asked (no database): what PostgreSQL's
    search_words would hand out."""

    def numbers(self, conn: Any, keys: set[str]) -> dict[str, int]:
        for key in sorted(keys):
            self.known.setdefault(key, len(self.known) + 1)
        return self.known


@pytest.mark.parametrize("seed", range(2))
def test_rows_are_numbered_by_their_search_keys(seed: int) -> None:
    """PostgreSQL's rows of a step: each row's numbers are those of its keys (search_keys of
    its words: each word's, each head's, a long word's own), sorted, each once."""
    rng = random.Random(seed)
    long_word = "q" * (search.MAX_WORD_CHARS + 5)
    numbering = _Numbering()
    for _ in range(300):
        texts = _texts(rng) + [f"Ab {long_word} abc {long_word[:-5]} x " + rng.choice(TRICKY)]
        rows = list(enumerate(texts))
        flat, starts, ends = search.number_rows(None, rows, numbering)  # type: ignore[arg-type]
        got = [
            flat.values[s - 1 : e].tolist()
            for s, e in zip(starts.values.tolist(), ends.values.tolist(), strict=True)
        ]
        keys = [search.search_keys(search.words(t).split()) for t in texts]
        assert got == [sorted(numbering.known[k] for k in each) for each in keys], texts
