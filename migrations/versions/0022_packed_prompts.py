"""Prompts stored compressed (issue 49): `prompts.text` becomes `prompts.packed`, its UTF-8 zstd-
compressed, against a prompt dictionary where `prompts.dictionary_id` names one
(`prompt_dictionaries`: raw content — the text of some prompts — zstd-compressed itself), as
server.store.prompt_texts writes them. A run's prompts share their template and tool listings,
which a dictionary holds once: the scale bench's 64-tool listings take 8 % of their bytes so
where zstd alone left 52 %.

The prompts written before are packed here ROWS_A_READ at a time in id order (a run's prompts
were written together, so a batch's prompts are mostly one run's), each batch against a
dictionary of its own first prompts (DICTIONARY_BYTES of them) where it holds DICTIONARY_FROM
bytes, as the store makes a run's. SQLite's `prompt_fts` indexed the prompts table's text
(external content, which it read to rebuild): it is made again contentless, holding the same
words, which the store removes with the text it hands it, as it does a run's completions.
PostgreSQL's `prompt_search` holds word numbers and is left as it is.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06 18:40:00
"""

import hashlib
from collections.abc import Iterator, Sequence

import sqlalchemy as sa
import zstandard
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROWS_A_READ = 500  # prompts read, packed and written at once (a 64-tool listing is ~4 KB)
# server.store.prompt_texts when 0022 was written
DICTIONARY_BYTES = 16_384
DICTIONARY_FROM = 4_096
_LEVEL = 3  # a prompt's, and a dictionary's (as server.store.arrays.encode_text's)
_TOKENIZER = "unicode61 remove_diacritics 0"  # server.store.search's
_FK = "fk_prompts_dictionary_id_prompt_dictionaries"


def upgrade() -> None:
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    op.create_table(
        "prompt_dictionaries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prompt_dictionaries")),
        sa.UniqueConstraint("sha256", name=op.f("uq_prompt_dictionaries_sha256")),
    )
    # In place on SQLite too (ALTER TABLE ADD COLUMN): a batch would rebuild prompts, which
    # rollouts refer to. A NOT NULL column needs a default there; every row gets its value.
    op.execute(
        "ALTER TABLE prompts ADD COLUMN dictionary_id INTEGER "
        f"CONSTRAINT {_FK} REFERENCES prompt_dictionaries (id)"
    )
    op.execute(
        "ALTER TABLE prompts ADD COLUMN packed bytea"
        if postgres
        else "ALTER TABLE prompts ADD COLUMN packed BLOB NOT NULL DEFAULT x''"
    )
    if postgres:  # each row's text goes with its update: its new version holds none
        op.execute("ALTER TABLE prompts ALTER COLUMN text DROP NOT NULL")
    else:
        op.execute("DROP TABLE prompt_fts")
        op.execute(
            "CREATE VIRTUAL TABLE prompt_fts USING fts5(text, content='', detail=none, "
            f"tokenize='{_TOKENIZER}')"
        )
    for rows in _batches(bind, "SELECT id, text FROM prompts"):
        _pack(bind, rows, postgres)
    if postgres:
        op.execute("ALTER TABLE prompts ALTER COLUMN packed SET NOT NULL")
        # compressed already: a long one goes out of line as it is, not after a failed attempt
        op.execute("ALTER TABLE prompts ALTER COLUMN packed SET STORAGE EXTERNAL")
    op.execute("ALTER TABLE prompts DROP COLUMN text")
    op.create_index(op.f("ix_prompts_dictionary_id"), "prompts", ["dictionary_id"])


def downgrade() -> None:
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    op.execute(
        "ALTER TABLE prompts ADD COLUMN text TEXT"
        if postgres
        else "ALTER TABLE prompts ADD COLUMN text TEXT NOT NULL DEFAULT ''"
    )
    for rows in _batches(bind, "SELECT id, dictionary_id, packed FROM prompts"):
        bind.execute(
            sa.text("UPDATE prompts SET text = :t WHERE id = :i"),
            [{"i": i, "t": t} for i, t in _unpack(bind, rows)],
        )
    if postgres:
        op.execute("ALTER TABLE prompts ALTER COLUMN text SET NOT NULL")
    op.drop_index(op.f("ix_prompts_dictionary_id"), table_name="prompts")
    if postgres:
        op.execute(f"ALTER TABLE prompts DROP CONSTRAINT {_FK}")
    op.execute("ALTER TABLE prompts DROP COLUMN packed")
    op.execute("ALTER TABLE prompts DROP COLUMN dictionary_id")
    op.drop_table("prompt_dictionaries")
    if not postgres:  # 0006's index over the prompts table's text
        op.execute("DROP TABLE prompt_fts")
        op.execute(
            "CREATE VIRTUAL TABLE prompt_fts USING fts5(text, content='prompts', "
            f"content_rowid='id', detail=none, tokenize='{_TOKENIZER}')"
        )
        op.execute("INSERT INTO prompt_fts (prompt_fts) VALUES ('rebuild')")


def _batches(bind: sa.Connection, select: str) -> Iterator[Sequence[sa.Row]]:
    """The prompts' rows, ROWS_A_READ at a time in id order (`select` reads id first)."""
    after = 0
    while True:
        rows = bind.execute(
            sa.text(f"{select} WHERE id > :after ORDER BY id LIMIT :n"),
            {"after": after, "n": ROWS_A_READ},
        ).all()
        if not rows:
            return
        after = rows[-1][0]
        yield rows


def _dictionary_bytes(raw: bytes) -> bytes:
    """Its first DICTIONARY_BYTES, cut back to the start of a character."""
    end = min(len(raw), DICTIONARY_BYTES)
    while end < len(raw) and raw[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        end -= 1
    return raw[:end]


def _raw(content: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(content, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def _pack(bind: sa.Connection, rows: Sequence[sa.Row], postgres: bool) -> None:
    """Pack one batch of (id, text) rows, against a dictionary of its first prompts where they
    hold DICTIONARY_FROM bytes; index them in SQLite's new prompt_fts."""
    raw = [text.encode("utf-8", "surrogatepass") for _, text in rows]
    dictionary_id = None
    compressor = zstandard.ZstdCompressor(level=_LEVEL)
    if sum(map(len, raw)) >= DICTIONARY_FROM:
        content = _dictionary_bytes(b"".join(raw))
        digest = hashlib.sha256(content).hexdigest()
        dictionary_id = bind.execute(
            sa.text("SELECT id FROM prompt_dictionaries WHERE sha256 = :h"), {"h": digest}
        ).scalar()
        if dictionary_id is None:
            data = compressor.compress(content)
            dictionary_id = bind.execute(
                sa.text("INSERT INTO prompt_dictionaries (sha256, data) VALUES (:h, :d) RETURNING id"),
                {"h": digest, "d": data},
            ).scalar_one()
        compressor = zstandard.ZstdCompressor(level=_LEVEL, dict_data=_raw(content))
    clear = ", text = NULL" if postgres else ""  # PostgreSQL's DROP COLUMN leaves rows as they are
    bind.execute(
        sa.text(f"UPDATE prompts SET packed = :p, dictionary_id = :d{clear} WHERE id = :i"),
        [
            {"i": row[0], "p": compressor.compress(b), "d": dictionary_id}
            for row, b in zip(rows, raw, strict=True)
        ],
    )
    if not postgres:
        bind.execute(
            sa.text("INSERT INTO prompt_fts (rowid, text) VALUES (:i, :t)"),
            [{"i": i, "t": text} for i, text in rows],
        )


def _unpack(bind: sa.Connection, rows: Sequence[sa.Row]) -> list[tuple[int, str]]:
    """(id, dictionary_id, packed) rows → (id, text)."""
    plain = zstandard.ZstdDecompressor()
    used = sorted({d for _, d, _ in rows if d is not None})
    found = bind.execute(
        sa.text("SELECT id, data FROM prompt_dictionaries WHERE id IN :ids").bindparams(
            sa.bindparam("ids", expanding=True)
        ),
        {"ids": used},
    ).all() if used else []
    decoders = {
        i: zstandard.ZstdDecompressor(dict_data=_raw(plain.decompress(data))) for i, data in found
    }
    return [
        (i, (plain if d is None else decoders[d]).decompress(packed).decode("utf-8", "surrogatepass"))
        for i, d, packed in rows
    ]
