"""How a prompt's text is stored: zstd-compressed (`prompts.packed`), against its run's prompt
dictionary where the run has one, and read back by id.

A run's prompts share most of their bytes — a chat template, a system prompt, a dataset's tool
listings — which zstd cannot find inside one prompt of a few KB (the scale bench's 64-tool
listings: 52 % of their bytes alone). A prompt dictionary (`prompt_dictionaries`) is the text of
the run's first new prompts, up to DICTIONARY_BYTES: zstd takes it as raw content, so every later
prompt of the run refers to the template and listings in it (those listings: 8 %, the
dictionary itself once, compressed). A run gets one when a write of its brings at least
DICTIONARY_FROM bytes of new prompts (a run of a few short prompts never does); a recorder
started again for the run (a resume, a rolled-back write) finds it through the run's prompts.
A prompt is shared by every run that gives it (by sha256) and keeps the dictionary it was
written with; a dictionary goes when its last prompt does (server.store.deletion).

Readers never see the bytes: `texts` gives prompt id → text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import zstandard
from rollout_lens.server.store import arrays
from rollout_lens.server.store.models import (
    PromptDictionaryRow,
    PromptRow,
    RolloutRow,
    RunPromptRow,
)
from rollout_lens.server.store.sql import upsert_insert
from sqlalchemy import Connection, delete, exists, select
from sqlalchemy.orm import Session

DICTIONARY_BYTES = 16_384  # the run's first new prompts a dictionary holds, at most
DICTIONARY_FROM = 4_096  # a write's new prompts make the run's dictionary from this many bytes
_LEVEL = 3  # zstd's level for a prompt against a dictionary (arrays.encode_text's for the rest)
_CHUNK = 500  # ids a statement (bounded IN lists)


def encode(text: str) -> bytes:
    """A text as the bytes it is compressed from (and hashed by)."""
    return text.encode("utf-8", "surrogatepass")


def dictionary_text(texts: Sequence[str]) -> str:
    """What a dictionary of these prompts holds: their text, its first DICTIONARY_BYTES bytes
    (cut back to the start of a character)."""
    raw = encode("".join(texts))
    end = min(len(raw), DICTIONARY_BYTES)
    while end < len(raw) and raw[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        end -= 1
    return raw[:end].decode("utf-8", "surrogatepass")


def _raw(content: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(content, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


class Packer:
    """Compresses one run's new prompts: against the run's dictionary once it has one (found
    in the database, or made from a write's new prompts). One recorder's: not for threads."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.dictionary_id: int | None = None
        self._compressor: zstandard.ZstdCompressor | None = None
        self._looked = False

    def pack(self, conn: Connection, texts: Sequence[str]) -> list[dict[str, object]]:
        """Each text as a prompts row's `packed` and `dictionary_id`."""
        if not self._looked:
            self._looked = True
            self._use(conn, _run_dictionary(conn, self.run_id))
        if self._compressor is None and sum(len(encode(t)) for t in texts) >= DICTIONARY_FROM:
            self._use(conn, _make_dictionary(conn, texts))
        compressor = self._compressor
        return [
            {
                "packed": arrays.encode_text(t)
                if compressor is None
                else compressor.compress(encode(t)),
                "dictionary_id": self.dictionary_id,
            }
            for t in texts
        ]

    def _use(self, conn: Connection, dictionary_id: int | None) -> None:
        if dictionary_id is None:
            return
        content = _dictionaries(conn, [dictionary_id])[dictionary_id]
        self.dictionary_id = dictionary_id
        self._compressor = zstandard.ZstdCompressor(level=_LEVEL, dict_data=_raw(content))


def _run_dictionary(conn: Connection, run_id: int) -> int | None:
    """The dictionary of one of the run's prompts (the one its writes used), if any has one."""
    found: int | None = conn.scalar(
        select(PromptRow.dictionary_id)
        .join(RunPromptRow, RunPromptRow.prompt_id == PromptRow.id)
        .where(RunPromptRow.run_id == run_id, PromptRow.dictionary_id.is_not(None))
        .limit(1)
    )
    return found


def _make_dictionary(conn: Connection, texts: Sequence[str]) -> int:
    """A dictionary of these prompts (dictionary_text), stored once by its sha256."""
    content = dictionary_text(texts)
    digest = hashlib.sha256(encode(content)).hexdigest()
    conn.execute(
        upsert_insert(conn, PromptDictionaryRow)
        .values(sha256=digest, data=arrays.encode_text(content))
        .on_conflict_do_nothing(index_elements=["sha256"])
    )
    made: int = conn.execute(
        select(PromptDictionaryRow.id).where(PromptDictionaryRow.sha256 == digest)
    ).scalar_one()
    return made


def _dictionaries(bind: Connection | Session, ids: Iterable[int]) -> dict[int, bytes]:
    """dictionary id → the bytes it holds."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    rows = bind.execute(
        select(PromptDictionaryRow.id, PromptDictionaryRow.data).where(
            PromptDictionaryRow.id.in_(wanted)
        )
    )
    return {i: encode(arrays.decode_text(data)) for i, data in rows}


def decode(
    bind: Connection | Session, rows: Iterable[tuple[int, int | None, bytes]]
) -> dict[int, str]:
    """(prompt id, dictionary id, packed) rows → prompt id → text (their dictionaries read)."""
    rows = list(rows)
    decoders = {
        i: zstandard.ZstdDecompressor(dict_data=_raw(content))
        for i, content in _dictionaries(bind, (d for _, d, _ in rows if d is not None)).items()
    }
    return {
        prompt_id: arrays.decode_text(packed)
        if d is None
        else decoders[d].decompress(packed).decode("utf-8", "surrogatepass")
        for prompt_id, d, packed in rows
    }


def texts(bind: Connection | Session, prompt_ids: Iterable[int]) -> dict[int, str]:
    """Prompt id → its text, for those of these ids that exist."""
    wanted = sorted(set(prompt_ids))
    rows: list[tuple[int, int | None, bytes]] = []
    for start in range(0, len(wanted), _CHUNK):
        found = bind.execute(
            select(PromptRow.id, PromptRow.dictionary_id, PromptRow.packed).where(
                PromptRow.id.in_(wanted[start : start + _CHUNK])
            )
        )
        rows += [(i, d, p) for i, d, p in found]
    return decode(bind, rows)


def with_prompts(
    bind: Connection | Session, rollouts: Sequence[RolloutRow]
) -> list[tuple[RolloutRow, str]]:
    """Each rollout with its prompt's text (each distinct prompt read once)."""
    found = texts(bind, {r.prompt_id for r in rollouts})
    return [(r, found[r.prompt_id]) for r in rollouts]


def forget_dictionaries(session: Session, dictionary_ids: Iterable[int]) -> None:
    """Delete those of these dictionaries that no prompt is compressed against any more."""
    wanted = sorted(set(dictionary_ids))
    if wanted:
        used = exists().where(PromptRow.dictionary_id == PromptDictionaryRow.id)
        session.execute(
            delete(PromptDictionaryRow).where(PromptDictionaryRow.id.in_(wanted), ~used)
        )
