"""A rollout's training–inference mismatch as scalars the explorer filters and sorts (issue 47):
`rollouts.abs_diff_max` (the largest |Δlogp| of its compared tokens) and
`rollouts.log_seq_ratio` (Σ log(p_trainer / p_generator): the log of its sequence ratio), each
under a (run_id, column) index; NULL where the rollout has no generator side or no token to
compare.

The store computes them on the write path from the logprobs as it keeps them
(server.store.recording.rollout_mismatch); this fills them for the rollouts recorded before,
from rollout_data's two blobs, with frozen copies of the store's logprob decoder
(server.store.arrays at this revision) and of server.core.mismatch's figures: a token is
compared where both sides are finite, log r = trainer − generator, its largest |log r| and the
sum of log r by numpy's add.reduceat (as core.mismatch.each_rollout sums it). Rollouts whose
arrays retention dropped (logprobs NULL) keep NULL: nothing to read. Read and written
ROWS_A_READ rollouts at a time, in id order.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06 09:30:00
"""

import math
import struct
from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
import zstandard
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("abs_diff_max", "log_seq_ratio")
ROWS_A_READ = 2000  # rollouts decoded and updated at once (~2 × 2,000 blobs in memory)


def upgrade() -> None:
    # Added in place on SQLite too (ALTER TABLE ADD COLUMN): a batch would rebuild rollouts.
    for column in COLUMNS:
        op.add_column("rollouts", sa.Column(column, sa.Float(), nullable=True))
    _backfill(op.get_bind())
    for column in COLUMNS:  # after the backfill: its updates need not maintain them
        # partial on PostgreSQL (a run's NULLs are no index its planner takes for run_id alone)
        op.create_index(
            f"ix_rollouts_run_id_{column}",
            "rollouts",
            ["run_id", column],
            postgresql_where=sa.text(f"{column} IS NOT NULL"),
        )


def downgrade() -> None:
    # In place on SQLite too (ALTER TABLE DROP COLUMN, SQLite 3.35+): a batch would copy
    # rollouts and drop the old table, whose implicit DELETE cascades to every rollout_data row.
    for column in COLUMNS:
        op.drop_index(f"ix_rollouts_run_id_{column}", table_name="rollouts")
        op.drop_column("rollouts", column)


# --- frozen copy of server.store.arrays' logprob decoder (0x01 bit-length coded, 0x04 bucket
# coded, else a byte-shuffled zstd frame of uint16 codes) ---

LOGPROB_SCALE = 4096
_LP_NAN, _LP_NEG_INF = 65535, 65534
_LENGTHS = struct.Struct("<BI")
_TOP = 3
_EXACT = 1 << (_TOP + 1)
_unzstd = zstandard.ZstdDecompressor()


def _bit_places(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    place = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, place.astype(np.uint32)


def _read_low_bits(data: bytes, offset: int, counts: np.ndarray) -> np.ndarray:
    if not len(counts) or not int(counts.max()):
        return np.zeros(len(counts), dtype=np.uint32)
    owner, place = _bit_places(counts)
    bits = np.unpackbits(
        np.frombuffer(data, np.uint8, offset=offset), count=len(owner), bitorder="little"
    )
    weights = (bits.astype(np.uint64) << place.astype(np.uint64)).astype(np.float64)
    return np.bincount(owner, weights, minlength=len(counts)).astype(np.uint32)


def _decode_bits(data: bytes) -> np.ndarray:
    _, size = _LENGTHS.unpack_from(data)
    at = _LENGTHS.size
    widths = np.frombuffer(_unzstd.decompress(data[at : at + size]), np.uint8).astype(np.int64)
    tail = np.maximum(widths - 1, 0)
    lead = np.where(widths > 0, np.left_shift(1, tail), 0).astype(np.uint32)
    return lead | _read_low_bits(data, at + size, tail)


def _decode_buckets(data: bytes) -> np.ndarray:
    _, size = _LENGTHS.unpack_from(data)
    at = _LENGTHS.size
    s = np.frombuffer(_unzstd.decompress(data[at : at + size]), np.uint8).astype(np.int64)
    big = s >= _EXACT
    rest = np.maximum(s - _EXACT, 0)
    below = np.where(big, rest // (1 << _TOP) + 1, 0)
    top = np.where(big, (1 << _TOP) + rest % (1 << _TOP), s)
    high = (top.astype(np.uint64) << below.astype(np.uint64)).astype(np.uint32)
    return high | _read_low_bits(data, at + size, below)


def _decode_logprobs(data: bytes | None) -> np.ndarray:
    if not data:
        return np.zeros(0)
    if data[0] == 0x01:
        codes = _decode_bits(data).astype(np.uint16)
    elif data[0] == 0x04:
        codes = _decode_buckets(data).astype(np.uint16)
    else:
        planes = np.frombuffer(_unzstd.decompress(data), np.uint8).reshape(2, -1)
        codes = planes.T.copy().view("<u2").reshape(-1)
    values = codes.astype(np.float64) / -LOGPROB_SCALE + 0.0
    values[codes == _LP_NEG_INF] = -math.inf
    values[codes == _LP_NAN] = math.nan
    return values


# --- frozen copy of server.core.mismatch.rollout_figures (no mask: the store keeps NaN on the
# generator's side where a position was not sampled) ---


def _figures(trainer: np.ndarray, generator: np.ndarray) -> tuple[float | None, float | None]:
    if not len(generator) or len(generator) != len(trainer):
        return None, None
    kept = np.isfinite(trainer) & np.isfinite(generator)
    if not kept.any():
        return None, None
    log_r = trainer[kept] - generator[kept]
    return float(np.max(np.abs(log_r))), float(np.add.reduceat(log_r, [0])[0])


def _backfill(bind: sa.engine.Connection) -> None:
    """Every rollout with both sides' arrays, ROWS_A_READ at a time in id order."""
    rollouts = sa.table("rollouts", sa.column("id"), *(sa.column(c) for c in COLUMNS))
    update = (
        sa.update(rollouts)
        .where(rollouts.c.id == sa.bindparam("rid"))
        .values(abs_diff_max=sa.bindparam("diff"), log_seq_ratio=sa.bindparam("ratio"))
    )
    after = -1
    while True:
        rows = bind.execute(
            sa.text(
                "SELECT rollout_id, logprobs, generator_logprobs FROM rollout_data "
                "WHERE rollout_id > :after AND generator_logprobs IS NOT NULL "
                "AND logprobs IS NOT NULL ORDER BY rollout_id LIMIT :n"
            ),
            {"after": after, "n": ROWS_A_READ},
        ).all()
        if not rows:
            return
        after = rows[-1][0]
        values = []
        for rid, logprobs, generator in rows:
            diff, ratio = _figures(_decode_logprobs(logprobs), _decode_logprobs(generator))
            if diff is not None:
                values.append({"rid": rid, "diff": diff, "ratio": ratio})
        if values:
            bind.execute(update, values)
