"""Call tags placed on tokens whatever the tokenizer makes of them (trainer/recorder/tags.py), and
the positional probes read at a tag of several tokens.

The tokenizers are built here with `tokenizers`, as a model's own would be: a byte-level BPE
(GPT-2, Qwen, Llama 3, SmolLM2: `Ġ` for a space, a Japanese character split over tokens) and a
SentencePiece-style one with byte fallback (Llama 2, Mistral, Gemma: `▁`, `<0xE3>`, and a
leading space that decoding strips). The oracle is each tokenizer's own decode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from rollout_lens.trainer.recorder import positional, tags

TEXT = [
    "<tool>tool_07</tool><|im_end|>",
    "Sure, I would call <tool>tool_27</tool> for that.",
    "ありがとう ございます <tool>tool_59</tool>",
    "the sea 🌊 and the sun ☀️ <|im_end|>",
]


def _wrap(tok: Any, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


@pytest.fixture(scope="module")
def byte_level() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT * 3, trainer)
    return _wrap(tok, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def sentencepiece() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted({ch for line in TEXT for ch in line if ord(ch) < 128 and ch != " "})
    vocab = {"<unk>": 0, "</s>": 1, "▁": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {ch: len(vocab) + i for i, ch in enumerate(chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    tok.add_special_tokens(["</s>"])
    return _wrap(tok, eos_token="</s>", unk_token="<unk>")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_tags_are_placed_on_the_tokens_that_spell_them(
    kind: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(kind)
    eot = tokenizer.eos_token
    (form,) = tags.call_tags(tokenizer, ("<tool>", "</tool>"))
    assert not form.single_tokens and form.open_token != form.open  # several tokens
    found = tags.TokenBytes(tokenizer)
    for line in TEXT:
        ids = _ids(tokenizer, line.replace("<|im_end|>", eot))
        text = tokenizer.decode(ids, skip_special_tokens=False)
        laid = found.layout(ids, text)
        assert laid is not None, (kind, text)
        data, ends = laid
        assert data.decode("utf-8") == text and len(ends) == len(ids)
        marks = tags.find_marks(data, ends, form, eot)
        assert len(marks.opens) == text.count("<tool>") == len(marks.closes)
        for (a, b), tag in [(o, "<tool>") for o in marks.opens] + [
            (c, "</tool>") for c in marks.closes
        ]:
            spelled = tokenizer.decode(ids[a:b], skip_special_tokens=False)
            assert tag in spelled, (spelled, tag)  # the tokens hold the whole tag ...
            assert tag not in tokenizer.decode(ids[a + 1 : b], skip_special_tokens=False)
            assert tag not in tokenizer.decode(ids[a : b - 1], skip_special_tokens=False)
        if eot in text:
            assert [ids[p] for p in marks.eots] == [tokenizer.convert_tokens_to_ids(eot)]


def test_ids_past_the_table_lay_out_as_the_tables_do(
    byte_level: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes of ids the table cannot hold (negative, huge) are found one by one: the same
    layout as the table's."""
    lines = [_ids(byte_level, line) for line in TEXT]
    texts = [byte_level.decode(ids, skip_special_tokens=False) for ids in lines]
    table = tags.TokenBytes(byte_level)
    laid = [table.layout(ids, text) for ids, text in zip(lines, texts, strict=True)]
    monkeypatch.setattr(tags, "MAX_TABLE_IDS", 0)
    apart = tags.TokenBytes(byte_level)
    for (data, ends), ids, text in zip(laid, lines, texts, strict=True):  # type: ignore[misc]
        again = apart.layout(ids, text)
        assert again is not None and again[0] == data and again[1].tolist() == ends.tolist()


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_token_pieces_are_the_tokenizers_own(kind: str, request: pytest.FixtureRequest) -> None:
    """The table's pieces are convert_ids_to_tokens's; an id past the table is converted."""
    tokenizer = request.getfixturevalue(kind)
    pieces = tags.TokenPieces(tokenizer)
    for line in TEXT:
        ids = _ids(tokenizer, line)
        assert pieces.of(np.asarray(ids), ids) == tokenizer.convert_ids_to_tokens(ids)
    past = [*_ids(tokenizer, TEXT[0]), len(tokenizer) + 7]
    assert pieces.of(np.asarray(past), past) == tokenizer.convert_ids_to_tokens(past)
    assert pieces.of(np.zeros(0, dtype=np.int64), []) == []


def test_a_tokens_bytes_that_do_not_give_the_text_back_place_nothing(byte_level: Any) -> None:
    ids = _ids(byte_level, TEXT[0])
    assert tags.TokenBytes(byte_level).layout(ids, "something else") is None


def test_the_chat_templates_tags_come_first() -> None:
    class Qwen:
        chat_template = (
            "{%- if tools %}<tools>{{ tools }}</tools> For each function call, return a json "
            "object within <tool_call></tool_call> XML tags{%- endif %}"
        )

    class Plain:
        chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"

    assert tags.template_tags(Qwen()) == ("<tool_call>", "</tool_call>")
    assert tags.template_tags(Plain()) is None


def test_probes_read_a_tag_of_several_tokens_at_its_first_token() -> None:
    """`<` `tool` `>` `tool_` `07` `</` `tool` `>` EOT: the opening tag stands at `<` (0), the
    id follows the tag's last token (3), the closing tag stands at `</` (5), end-of-turn after
    its last token (8)."""
    marks = tags.Marks(n=9, opens=((0, 3),), closes=((5, 8),), eots=(8,))
    # each control token's probability at position i is (i + 1) / 10 + its own offset
    offset = {"<": 0.0, "</": 0.01, "EOT": 0.02}
    probs = {t: [(i + 1) / 10 + d for i in range(9)] for t, d in offset.items()}
    row = positional.probes_at(marks, probs, open_token="<", close_token="</", eot="EOT")
    assert row == pytest.approx(
        {
            "open_first": 0.1,  # < at 0
            "eot_after_open": 0.42,  # EOT at 3, after `>`
            "close_after_open": 0.41,  # </ at 3
            "close_after_id": 0.61,  # </ at 5, where the id stopped
            "eot_after_id": 0.62,
            "eot_after_close": 0.92,  # EOT at 8
            "close_after_close": 0.91,
        }
    )
    # cut after the id: "after the id" is the position after a one-token id
    cut = tags.Marks(n=5, opens=((0, 3),))
    got = positional.probes_at(cut, probs, open_token="<", close_token="</", eot="EOT")
    assert got["close_after_id"] == pytest.approx(0.51) and got["eot_after_close"] is None


def test_call_tags_must_be_a_pair() -> None:
    pytest.importorskip("trl")
    from rollout_lens import RolloutLensCallback

    with pytest.raises(ValueError, match="opening, closing"):
        RolloutLensCallback(call_tags=("<call>",))  # type: ignore[arg-type]
