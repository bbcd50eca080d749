"""A step's text rules found in numpy passes (server/store/rule_match.py) are arrays.pieces_rule's,
the oracle that joins each rollout's texts and compares them: on byte-level, SentencePiece and
plain pieces, long ones, characters split over tokens, lone surrogates, end-of-turn tokens left
out, and texts a byte away from the pieces' in every place."""

from __future__ import annotations

import contextlib
import itertools
import random

import numpy as np
import pytest
from rollout_lens.server.core.tokentext import byte_level_table, piece_bytes
from rollout_lens.server.store import arrays
from rollout_lens.server.store.rule_match import PieceTables

_TO_BYTE_LEVEL = {ord(b): c for c, b in byte_level_table().items()}  # byte → its character
_WORDS = ["the", "tool", "ö", "日本語", "🙂", "x" * 9, "y" * 16, "z" * 17, "\ud800", "<|im_end|>"]


def _byte_level(text: str, rng: random.Random) -> list[str]:
    """A text's UTF-8 bytes cut in random places (inside characters too), as byte-level pieces."""
    raw = text.encode("utf-8", "surrogatepass")
    cuts = sorted({0, len(raw), *(rng.randrange(len(raw) + 1) for _ in range(len(raw) // 3))})
    return ["".join(chr(_TO_BYTE_LEVEL[b]) for b in raw[a:b]) for a, b in itertools.pairwise(cuts)]


def _sentencepiece(words: list[str], rng: random.Random) -> list[str]:
    pieces = []
    for word in words:
        if rng.random() < 0.2:  # byte fallback
            pieces += [f"<0x{b:02X}>" for b in word.encode("utf-8", "surrogatepass")]
        else:
            pieces.append("\u2581" + word)
    return pieces


def _case(rng: random.Random) -> list[str]:
    words = [rng.choice(_WORDS) for _ in range(rng.randrange(0, 12))]
    kind = rng.randrange(3)
    if kind == 0:
        pieces = [w + rng.choice(["", " ", "\n"]) for w in words]
    elif kind == 1:
        pieces = _byte_level(" ".join(words), rng) if words else []
    else:
        pieces = _sentencepiece(words, rng)
    if rng.random() < 0.4:
        pieces += rng.sample(["<|im_end|>", "</s>", "\u2581", ""], rng.randrange(1, 3))
    return pieces


def _texts_of(pieces: list[str], rng: random.Random) -> list[str]:
    """Texts a rule gives these pieces, and each a character away (added, removed, changed)."""
    out = []
    for rule, build in arrays.TEXT_RULES.items():
        for dropped in range(3):
            try:
                text = build(pieces[: len(pieces) - dropped])
            except (ValueError, UnicodeError):
                continue
            out.append(text)
            at = rng.randrange(len(text) + 1)
            out.append(text[:at] + rng.choice("a \u00e9\ud800") + text[at:])
            if text:
                out.append(text[:at] + text[at + 1 :])
                out.append(" " + text)
        kept = pieces[: len(pieces) - rng.randrange(3)]
        with contextlib.suppress(UnicodeError):  # the bytes read with their lone surrogates
            out.append(
                b"".join(piece_bytes(p, rule) for p in kept).decode("utf-8", "surrogatepass")
            )
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_steps_rules_are_the_joined_texts_rules(seed: int) -> None:
    rng = random.Random(seed)
    vocabulary: dict[str, int] = {}
    rows: list[list[int]] = []
    texts: list[str] = []
    for _ in range(60):
        pieces = _case(rng)
        for text in _texts_of(pieces, rng) or [""]:
            rows.append([vocabulary.setdefault(p, len(vocabulary) + 3) for p in pieces])
            texts.append(text)
    by_id = {i: p for p, i in vocabulary.items()}
    ids = np.array([i for row in rows for i in row], dtype=np.int64)
    bounds = np.cumsum([0, *map(len, rows)])
    expected = [
        arrays.pieces_rule(text, [by_id[i] for i in row]) if row else None
        for row, text in zip(rows, texts, strict=True)
    ]
    # half the pieces first (the tables are built from them), the rest learned after
    known = dict(list(by_id.items())[: len(by_id) // 2])
    tables = PieceTables(known, max(by_id) + 1)
    first = np.array([bool(row) and all(i in known for i in row) for row in rows])
    got = tables.rules(np.where(np.isin(ids, list(known)), ids, 0), bounds, texts, first)
    assert got == [e if ok else None for e, ok in zip(expected, first, strict=True)]
    new = [i for i in by_id if i not in known]
    known.update({i: by_id[i] for i in new})
    tables.learn(new)
    assert tables.rules(ids, bounds, texts, np.diff(bounds) > 0) == expected
    assert {r % 8 for r in expected if r} == {1, 2, 3, 4}  # every rule met
    assert {r // 8 for r in expected if r} == {0, 1, 2}  # and every count of tokens left out
    assert expected.count(None) > len(expected) // 4


def test_rollouts_not_usable_are_left_to_the_caller() -> None:
    tables = PieceTables({1: "Hello", 2: " world"}, 4)
    ids = np.array([1, 2, 1, 2], dtype=np.int64)
    texts = ["Hello world", "Hello world"]
    usable = np.array([True, False])
    assert tables.rules(ids, np.array([0, 2, 4]), texts, usable) == [1, None]


@pytest.mark.parametrize(("rule", "dropped"), [(1, 0), (2, 1), (3, 2), (4, 0), (4, 1)])
def test_a_step_all_of_one_rule(rule: int, dropped: int) -> None:
    """Every rollout a candidate (the pass over the step's tokens as they lie), one of them a
    byte off in a long token's last word."""
    rng = random.Random(rule)
    build = arrays.TEXT_RULES[rule]
    vocabulary: dict[str, int] = {}
    rows, texts = [], []
    for _ in range(40):
        words = [rng.choice(_WORDS[:8]) for _ in range(rng.randrange(3, 10))]
        pieces = _byte_level(" ".join(words), rng) if rule == 2 else _sentencepiece(words, rng)
        pieces = pieces if rule != 1 else [w + " " for w in words]
        pieces += ["<|im_end|>", "</s>"][:dropped]
        rows.append([vocabulary.setdefault(p, len(vocabulary)) for p in pieces])
        texts.append(build(pieces[: len(pieces) - dropped]))
    texts[-1] = texts[-1].replace("z" * 17, "z" * 16 + "Z")
    by_id = {i: p for p, i in vocabulary.items()}
    tables = PieceTables(by_id, len(by_id))
    ids = np.array([i for row in rows for i in row], dtype=np.int64)
    bounds = np.cumsum([0, *map(len, rows)])
    got = tables.rules(ids, bounds, texts, np.ones(len(rows), dtype=bool))
    expected = [
        arrays.pieces_rule(text, [by_id[i] for i in row])
        for row, text in zip(rows, texts, strict=True)
    ]
    assert got == expected
    assert expected[:-1].count(rule + 8 * dropped) >= 20
