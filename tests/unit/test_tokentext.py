"""Tokens read as text (server.core.tokentext), table-driven: byte-level BPE and SentencePiece
pieces → each token's text, cells that merge a character split over tokens, the rule a stored
rollout reads by. The oracle against real tokenizers is tests/store/test_tokentext_tokenizers.py."""

from __future__ import annotations

import random

import pytest
from rollout_lens.server.core import tokentext
from rollout_lens.server.core.tokentext import (
    BYTE_LEVEL,
    JOIN,
    SENTENCEPIECE,
    SENTENCEPIECE_STRIPPED,
    TEXT_RULES,
)
from rollout_lens.server.store import arrays

FFFD = "\ufffd"

# (what, pieces, rule, each token's text); the pieces are SmolLM2-135M-Instruct's where it has them
TEXTS = [
    ("ASCII words", ["Hello", ",", "Ġcan", "Ġyou"], BYTE_LEVEL, ["Hello", ",", " can", " you"]),
    ("newlines", ["?", "Ċ", "ĊĊ", "ĉx"], BYTE_LEVEL, ["?", "\n", "\n\n", "\tx"]),
    # 日 is e6 97 a5 over two tokens, 本 one token, 語 three
    ("Japanese", ["æĹ", "¥", "æľ¬", "è", "ª", "ŀ"], BYTE_LEVEL, ["", "日", "本", "", "", "語"]),
    ("an emoji over 3 tokens", ["ĠðŁ", "İ", "ī", "Ġok"], BYTE_LEVEL, [" ", "", "🎉", " ok"]),
    ("a lone continuation byte", ["a", "ī", "b"], BYTE_LEVEL, ["a", FFFD, "b"]),
    ("a character cut by the end", ["Ġok", "ĠðŁ"], BYTE_LEVEL, [" ok", " " + FFFD]),
    ("a lead byte then ASCII", ["ãģ", "A"], BYTE_LEVEL, ["", FFFD + "A"]),
    (
        "special tokens",
        ["Ġok", "<|im_end|>", "<|im_start|>"],
        BYTE_LEVEL,
        [" ok", "<|im_end|>", "<|im_start|>"],
    ),  # fmt: skip
    # an added token with characters outside the byte-level alphabet is its own text
    (
        "an added token",
        ["<｜end▁of▁sentence｜>", "<think> "],
        BYTE_LEVEL,
        ["<｜end▁of▁sentence｜>", "<think> "],
    ),  # fmt: skip
    (
        "a stored rule with a dropped token",
        ["Ġok", "<|im_end|>"],
        BYTE_LEVEL + 8,
        [" ok", "<|im_end|>"],
    ),  # fmt: skip
    ("SentencePiece ▁", ["▁Hello", "▁world", "!"], SENTENCEPIECE, [" Hello", " world", "!"]),
    ("SentencePiece, stripped", ["▁Hello", "▁world"], SENTENCEPIECE_STRIPPED, ["Hello", " world"]),
    ("a stripped lone ▁", ["▁", "Hi", "▁there"], SENTENCEPIECE_STRIPPED, ["", "Hi", " there"]),
    # あ is e3 81 82: three byte-fallback tokens
    ("byte fallback", ["▁", "<0xE3>", "<0x81>", "<0x82>"], SENTENCEPIECE, [" ", "", "", "あ"]),
    ("byte fallback newline", ["a", "<0x0A>", "b"], SENTENCEPIECE_STRIPPED, ["a", "\n", "b"]),
    ("not a byte token", ["<0xZZ>", "<0x0A"], SENTENCEPIECE, ["<0xZZ>", "<0x0A"]),
    ("byte fallback cut", ["▁x", "<0xE3>"], SENTENCEPIECE, [" x", FFFD]),
    (
        "the tiny models' pieces",
        ["<tool>", "tool_07", "</tool>", " a", "\n"],
        JOIN,
        ["<tool>", "tool_07", "</tool>", " a", "\n"],
    ),  # fmt: skip
]


@pytest.mark.parametrize(("pieces", "rule", "expected"), [t[1:] for t in TEXTS], ids=[t[0] for t in TEXTS])  # fmt: skip
def test_each_token_reads_as_the_text_it_contributes(
    pieces: list[str], rule: int, expected: list[str]
) -> None:
    texts = tokentext.token_texts(pieces, rule)
    assert texts == expected
    assert len(texts) == len(pieces)  # one entry per id: aligned with the logprobs
    # joined they are the whole text, where the rule rebuilds one
    try:
        whole = TEXT_RULES[rule % 8](pieces)
    except UnicodeError:
        return
    assert "".join(texts) == whole


def test_a_window_leaves_an_open_character_open() -> None:
    assert tokentext.token_texts(["Ġok", "ĠðŁ"], BYTE_LEVEL, final=False) == [" ok", " "]
    assert tokentext.token_texts(["Ġok", "ĠðŁ"], BYTE_LEVEL) == [" ok", " " + FFFD]


# (what, pieces, rule, cells as (text, first, last))
CELLS = [
    ("one cell a token", ["Hello", "Ġcan"], BYTE_LEVEL, [("Hello", 0, 0), (" can", 1, 1)]),
    (
        "an emoji over 3 tokens is one cell",
        ["Ġok", "ĠðŁ", "İ", "ī"],
        BYTE_LEVEL,
        [(" ok", 0, 0), (" 🎉", 1, 3)],
    ),  # fmt: skip
    (
        "Japanese",
        ["æĹ", "¥", "æľ¬", "ãģ", "®"],
        BYTE_LEVEL,
        [("日", 0, 1), ("本", 2, 2), ("の", 3, 4)],
    ),  # fmt: skip
    (
        "a lone continuation byte is its own cell",
        ["a", "ī"],
        BYTE_LEVEL,
        [("a", 0, 0), (FFFD, 1, 1)],
    ),  # fmt: skip
    ("cut by the end", ["a", "ãģ"], BYTE_LEVEL, [("a", 0, 0), (FFFD, 1, 1)]),
    (
        "byte fallback",
        ["▁", "<0xE3>", "<0x81>", "<0x82>", "▁x"],
        SENTENCEPIECE_STRIPPED,
        [("", 0, 0), ("あ", 1, 3), (" x", 4, 4)],
    ),  # fmt: skip
    ("join", ["<tool>", ""], JOIN, [("<tool>", 0, 0), ("", 1, 1)]),
]


@pytest.mark.parametrize(("pieces", "rule", "expected"), [c[1:] for c in CELLS], ids=[c[0] for c in CELLS])  # fmt: skip
def test_cells_merge_the_tokens_of_one_character(
    pieces: list[str], rule: int, expected: list[tuple[str, int, int]]
) -> None:
    cells = tokentext.cells(pieces, rule)
    assert [(c.text, c.first, c.last) for c in cells] == expected
    assert "".join(c.text for c in cells) == "".join(tokentext.token_texts(pieces, rule))


# (piece, rule, bytes)
BYTES = [
    ("Ġ", BYTE_LEVEL, b" "),
    ("Ċ", BYTE_LEVEL, b"\n"),
    ("ĠðŁ", BYTE_LEVEL, b" \xf0\x9f"),
    ("ī", BYTE_LEVEL, b"\x89"),
    ("<|im_end|>", BYTE_LEVEL, b"<|im_end|>"),
    ("<think> ", BYTE_LEVEL, b"<think> "),
    ("▁a", SENTENCEPIECE, b" a"),
    ("<0xE3>", SENTENCEPIECE_STRIPPED, b"\xe3"),
    ("<0xe3>", SENTENCEPIECE, b"\xe3"),
    ("▁a", JOIN, "▁a".encode()),
]


@pytest.mark.parametrize(("piece", "rule", "expected"), BYTES)
def test_piece_bytes(piece: str, rule: int, expected: bytes) -> None:
    assert tokentext.piece_bytes(piece, rule) == expected


# (what, pieces, the rule they read by)
INFERRED = [
    ("byte-level", ["Hello", "Ġcan"], BYTE_LEVEL),
    ("byte-level with a special token", ["Ġok", "<|im_end|>"], BYTE_LEVEL),
    ("SentencePiece", ["▁Hello", "▁world"], SENTENCEPIECE_STRIPPED),
    ("byte fallback", ["<0xE3>", "<0x81>"], SENTENCEPIECE_STRIPPED),
    ("the tiny models' pieces", ["<tool>", " a", "\n"], JOIN),
    # Latin Extended-A in text that has spaces is not byte-level's alphabet
    ("Polish text", ["łódź", " ok"], JOIN),
    ("nothing", [], JOIN),
]


@pytest.mark.parametrize(("pieces", "rule"), [i[1:] for i in INFERRED], ids=[i[0] for i in INFERRED])  # fmt: skip
def test_the_rule_of_stored_pieces(pieces: list[str], rule: int) -> None:
    assert tokentext.infer_rule(pieces) == rule
    # a stored rule wins over what the pieces show
    assert tokentext.rule_for(None, pieces) == rule
    assert tokentext.rule_for(SENTENCEPIECE + 8, pieces) == SENTENCEPIECE


def test_matching_rule_finds_the_rule_that_gave_the_texts() -> None:
    pieces = ["▁Hello", "▁world"]
    assert tokentext.matching_rule(pieces, ["Hello", " world"]) == SENTENCEPIECE_STRIPPED
    assert tokentext.matching_rule(pieces, [" Hello", " world"]) == SENTENCEPIECE
    # 'Ã©' is é's bytes in byte-level BPE, with no remapped character to show it
    assert tokentext.matching_rule(["caf", "Ã©"], ["caf", "é"]) == BYTE_LEVEL
    assert tokentext.matching_rule(["ĠðŁ"], [" " + FFFD]) == BYTE_LEVEL


def test_control_token_names_read_as_text() -> None:
    assert tokentext.piece_text("Ġ<") == " <"
    assert tokentext.piece_text("<|im_end|>") == "<|im_end|>"
    assert tokentext.piece_text("</tool>") == "</tool>"
    assert tokentext.piece_text("▁<") == " <"


def test_a_character_split_across_tokens_is_in_the_token_that_completes_it() -> None:
    pieces = ["Ġ<", "tool", ">", "ĠðŁ", "İ", "ī", "Ċ"]
    texts = tokentext.token_texts(pieces, BYTE_LEVEL)
    # 🎉's four bytes span three tokens: the first keeps its space, the last holds the emoji
    assert texts == [" <", "tool", ">", " ", "", "🎉", "\n"]


def test_arrays_rebuild_by_the_same_rules() -> None:
    """One place knows how pieces become text: the store's TEXT_RULES are the core's."""
    assert arrays.TEXT_RULES is TEXT_RULES
    # a special token with characters outside the alphabet no longer stops byte-level rebuilding
    texts = {1: "Ġok", 2: "<｜end▁of▁sentence｜>"}
    assert arrays.text_rule(" ok<｜end▁of▁sentence｜>", [1, 2], texts) == BYTE_LEVEL


ALPHABET = ["Ġ", "Ċ", "a", "ðŁ", "İ", "ī", "æĹ", "¥", "ãģ", "<|im_end|>", "é"]
SP_ALPHABET = ["▁", "a", "<0xE3>", "<0x81>", "<0x82>", "▁b", "<0x0A>", "</s>"]


@pytest.mark.parametrize(
    ("alphabet", "rule"),
    [(ALPHABET, BYTE_LEVEL), (SP_ALPHABET, SENTENCEPIECE), (SP_ALPHABET, SENTENCEPIECE_STRIPPED)],
)
def test_texts_and_cells_join_to_the_decoded_bytes(alphabet: list[str], rule: int) -> None:
    """Random pieces: the texts join to the pieces' bytes decoded with U+FFFD for what is not
    UTF-8 (the inverse of the bytes each piece stands for), and cells join to the same."""
    rng = random.Random(7)
    for _ in range(500):
        pieces = [rng.choice(alphabet) for _ in range(rng.randrange(0, 12))]
        data = b"".join(tokentext.piece_bytes(p, rule) for p in pieces)
        decoded = data.decode("utf-8", "replace")
        if rule == SENTENCEPIECE_STRIPPED and decoded.startswith(" "):
            decoded = decoded[1:]
        texts = tokentext.token_texts(pieces, rule)
        assert "".join(texts) == decoded and len(texts) == len(pieces)
        cells = tokentext.cells(pieces, rule)
        assert "".join(c.text for c in cells) == decoded
        # the cells cover every token once, in order
        assert [i for c in cells for i in range(c.first, c.last + 1)] == list(range(len(pieces)))
