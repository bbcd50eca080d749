"""storage at scale: per-token arrays apart from rollouts' scalars, compressed; sparse
control-token probabilities; completion text rebuilt from ids where it can be; full-text search

Moves every rollout without losing one: its float16 arrays become rollout_data's compressed
arrays (ids exact, logprobs to 1/4096 nat, control-token probabilities at or above 0.001), its
text is kept only where the run's token texts do not rebuild it exactly, and completions and
prompts are indexed for search (SQLite FTS5, PostgreSQL tsvector + GIN).

This file carries its own copy of the codec and the text rules as they were when it was written
(server/store/arrays.py and search.py may change later; what this migration wrote may not).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 08:40:00
"""

import json
import re
import struct
from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
import zstandard
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 1000
_INDEXED = (
    "format_state",
    "format_valid",
    "vote",
    "target",
    "verifier_reward",
    "true_score",
    "advantage",
    "n_tokens",
    "disagree",
)
_Z = zstandard.ZstdCompressor(level=3)
_SEARCH_CHARS = 200_000
_TOKENIZER = "unicode61 remove_diacritics 0"
_PG_PROMPT_WORDS = (
    "to_tsvector('simple', regexp_replace(left(text, 200000), '[^[:alnum:]]+', ' ', 'g'))"
)


def upgrade() -> None:
    conn = op.get_bind()
    postgres = conn.dialect.name == "postgresql"
    op.create_table(
        "rollout_data",
        sa.Column("rollout_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("ids", sa.LargeBinary(), nullable=True),
        sa.Column("logprobs", sa.LargeBinary(), nullable=True),
        sa.Column("control", sa.LargeBinary(), nullable=True),
        sa.Column("text", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(
            ["rollout_id"],
            ["rollouts.id"],
            name=op.f("fk_rollout_data_rollout_id_rollouts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("rollout_id", name=op.f("pk_rollout_data")),
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("n_tokens", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("text_rule", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("disagree", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    if postgres:
        op.execute(
            "CREATE TABLE rollout_search (rollout_id INTEGER PRIMARY KEY "
            "REFERENCES rollouts(id) ON DELETE CASCADE, doc tsvector NOT NULL)"
        )
        op.execute("CREATE INDEX ix_rollout_search_doc ON rollout_search USING gin (doc)")
        op.execute(f"CREATE INDEX ix_prompts_search ON prompts USING gin ({_PG_PROMPT_WORDS})")
    else:
        op.execute(
            "CREATE VIRTUAL TABLE prompt_fts USING fts5(text, content='prompts', "
            f"content_rowid='id', detail=none, tokenize='{_TOKENIZER}')"
        )
        op.execute("INSERT INTO prompt_fts (prompt_fts) VALUES ('rebuild')")

    runs = conn.execute(sa.text("SELECT id, control_tokens FROM runs ORDER BY id")).all()
    for run_id, control_tokens in runs:
        tokens = control_tokens if isinstance(control_tokens, list) else json.loads(control_tokens or "[]")
        _move_rollouts(conn, run_id, len(tokens), postgres)

    # Verifier and truth disagree: the verifier passed (reward >= 0.5) a rollout whose true score
    # is 0, or failed one whose true score is 1 (server.core.records.disagrees when 0006 was written).
    op.execute(
        "UPDATE rollouts SET disagree = COALESCE((verifier_reward >= 0.5 AND true_score = 0) "
        "OR (verifier_reward < 0.5 AND true_score >= 1), false)"
    )
    for column in _INDEXED:
        op.create_index(f"ix_rollouts_run_id_{column}", "rollouts", ["run_id", column])
    # Native DROP COLUMN (SQLite 3.35+): batch mode would copy the table and drop the old one,
    # which deletes every rollout_data row through the foreign key's cascade.
    for column in ("completion", "completion_ids", "token_logprobs", "control_probs"):
        op.execute(f"ALTER TABLE rollouts DROP COLUMN {column}")
    if not postgres:  # the explorer's plans need the statistics (the recorder keeps them fresh)
        op.execute("PRAGMA analysis_limit = 2000")
        op.execute("ANALYZE rollouts")


def _move_rollouts(conn: sa.Connection, run_id: int, n_control: int, postgres: bool) -> None:
    texts = dict(
        conn.execute(
            sa.text("SELECT token_id, text FROM run_tokens WHERE run_id = :r"), {"r": run_id}
        ).all()
    )
    if not postgres:
        conn.exec_driver_sql(
            f"CREATE VIRTUAL TABLE rollout_fts_{int(run_id)} USING fts5("
            f"text, content='', detail=none, tokenize='{_TOKENIZER}')"
        )
    after = 0
    while True:
        rows = conn.execute(
            sa.text(
                "SELECT id, completion, completion_ids, token_logprobs, control_probs "
                "FROM rollouts WHERE run_id = :r AND id > :after ORDER BY id LIMIT :n"
            ),
            {"r": run_id, "after": after, "n": BATCH},
        ).all()
        if not rows:
            return
        after = rows[-1][0]
        data, scalars, search = [], [], []
        for rid, completion, ids_blob, lp_blob, ctrl_blob in rows:
            if ids_blob is None:  # retention had dropped its arrays: the text is all there is
                ids, rule = None, None
            else:
                ids = list(struct.unpack(f"<{len(ids_blob) // 4}i", ids_blob))
                rule = _text_rule(completion, ids, texts)
            data.append(
                {
                    "r": rid,
                    "i": None if ids is None else _encode_ids(ids),
                    "l": None if lp_blob is None else _encode_logprobs(_halves(lp_blob)),
                    "c": None
                    if ctrl_blob is None
                    else _encode_control(_half_rows(ctrl_blob, n_control), len(ids or [])),
                    "t": None if rule is not None else _Z.compress(completion.encode("utf-8", "surrogatepass")),
                }
            )
            scalars.append({"r": rid, "n": None if ids is None else len(ids), "rule": rule})
            search.append((rid, completion))
        conn.execute(
            sa.text(
                "INSERT INTO rollout_data (rollout_id, ids, logprobs, control, text) "
                "VALUES (:r, :i, :l, :c, :t)"
            ),
            data,
        )
        conn.execute(
            sa.text("UPDATE rollouts SET n_tokens = :n, text_rule = :rule WHERE id = :r"), scalars
        )
        if postgres:
            conn.exec_driver_sql(
                "INSERT INTO rollout_search (rollout_id, doc) "
                "VALUES (%s, strip(to_tsvector('simple', %s)))",
                [(rid, _words(t)) for rid, t in search],
            )
        else:
            conn.exec_driver_sql(
                f"INSERT INTO rollout_fts_{int(run_id)} (rowid, text) VALUES (?, ?)",
                [(rid, _words(t)) for rid, t in search],
            )


def _words(text: str) -> str:
    # each distinct word once, lower-cased: what both engines index (server.store.search.words)
    return " ".join(dict.fromkeys(re.findall(r"[^\W_]+", text[:_SEARCH_CHARS].lower())))


def _halves(blob: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(blob) // 2}e", blob))


def _half_rows(blob: bytes, n_rows: int) -> list[list[float]]:
    flat = _halves(blob)
    if n_rows == 0 or not flat:
        return [[] for _ in range(n_rows)]
    width = len(flat) // n_rows
    return [flat[i * width : (i + 1) * width] for i in range(n_rows)]


def _shuffle(values: np.ndarray) -> bytes:
    raw = values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8)
    return raw.reshape(-1, values.dtype.itemsize).T.tobytes()


def _encode_ids(ids: list[int]) -> bytes:
    return _Z.compress(_shuffle(np.asarray(ids, dtype=np.int32)))


def _encode_logprobs(logprobs: list[float]) -> bytes:
    lp = np.asarray(logprobs, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        steps = np.rint(np.clip(-lp, 0.0, 15.0) * 4096)
    codes = np.where(np.isnan(lp), 65535, np.where(np.isneginf(lp), 65534, 0))
    codes = np.where(codes == 0, np.nan_to_num(steps), codes).astype(np.uint16)
    return _Z.compress(_shuffle(codes))


def _encode_control(rows: list[list[float]], length: int) -> bytes:
    # [length, each row's count] u4, then every row's gaps between kept positions (u4, from 0
    # for a row's first) and every row's codes (u2, 1/32768; NaN 65535), each shuffled
    counts, gaps, codes = [], [], []
    for row in rows:
        values = np.zeros(length, dtype=np.float64)
        given = np.asarray(row[:length], dtype=np.float64)
        values[: len(given)] = given
        kept = np.flatnonzero(~(values < 1e-3))
        counts.append(len(kept))
        gaps.append(np.diff(kept, prepend=0).astype(np.uint32))
        p = values[kept]
        code = np.rint(np.clip(np.nan_to_num(p, nan=0.0), 0.0, 1.0) * 32768).astype(np.uint16)
        code[np.isnan(p)] = 65535
        codes.append(code)
    head = np.array([length, *counts], dtype="<u4").tobytes()
    gap_bytes = _shuffle(np.concatenate(gaps) if gaps else np.zeros(0, np.uint32))
    code_bytes = _shuffle(np.concatenate(codes) if codes else np.zeros(0, np.uint16))
    return _Z.compress(head + gap_bytes + code_bytes)


def _byte_table() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {c: chr(b) for b, c in zip(printable, chars)}


_BYTES = _byte_table()


def _sentencepiece(pieces: list[str]) -> str:
    out = bytearray()
    for piece in pieces:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(int(piece[3:5], 16))
        else:
            out += piece.replace("▁", " ").encode("utf-8")
    return out.decode("utf-8")


_RULES = {
    1: lambda p: "".join(p),
    2: lambda p: "".join(p).translate(_BYTES).encode("latin-1").decode("utf-8"),
    3: _sentencepiece,
    4: lambda p: (lambda t: t[1:] if t.startswith(" ") else t)(_sentencepiece(p)),
}


def _text_rule(text: str, ids: list[int], texts: dict[int, str]) -> int | None:
    if not ids or any(i not in texts for i in ids):
        return None
    pieces = [texts[i] for i in ids]
    for dropped in range(min(2, len(pieces) - 1) + 1):
        kept = pieces[: len(pieces) - dropped]
        for rule, build in _RULES.items():
            try:
                if build(kept) == text:
                    return rule + 8 * dropped
            except (ValueError, UnicodeError):
                continue
    return None


def downgrade() -> None:
    raise NotImplementedError("0006 compresses rollouts' arrays; restore a backup to go back")
