"""format_valid may be unknown (NULL: the recorder had no format_valid function); a vote or
target may be up to 256 characters (a tool-calling rollout's final answer is its vote)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SQLite changes a column by rebuilding its table, and dropping the old `rollouts` would cascade
# into `rollout_data` (every rollout's arrays) under the foreign keys this app turns on, a pragma
# that cannot be changed inside the migration's transaction. A dropped NOT NULL and a declared
# length (which SQLite does not enforce) leave the stored rows as they are, so SQLite's own
# procedure for such changes applies: edit the table's CREATE statement in the schema
# (https://sqlite.org/lang_altertable.html#otheralter), then bump the schema version.
_SQLITE_EDITS = (
    ("format_valid BOOLEAN NOT NULL", "format_valid BOOLEAN"),
    ("target VARCHAR(64)", "target VARCHAR(256)"),
    ("vote VARCHAR(64)", "vote VARCHAR(256)"),
)


def _sqlite_schema(edits: Sequence[tuple[str, str]]) -> None:
    conn = op.get_bind()
    sql = conn.scalar(sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'rollouts'"))
    for old, new in edits:
        if old not in sql:
            raise RuntimeError(f"rollouts has no {old!r} to change: {sql}")
        sql = sql.replace(old, new)
    version = conn.scalar(sa.text("PRAGMA schema_version"))
    conn.execute(sa.text("PRAGMA writable_schema = ON"))
    conn.execute(
        sa.text("UPDATE sqlite_master SET sql = :sql WHERE type = 'table' AND name = 'rollouts'"),
        {"sql": sql},
    )
    conn.execute(sa.text(f"PRAGMA schema_version = {int(version) + 1}"))
    conn.execute(sa.text("PRAGMA writable_schema = OFF"))


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _sqlite_schema(_SQLITE_EDITS)
        return
    op.alter_column("rollouts", "format_valid", existing_type=sa.Boolean(), nullable=True)
    for column in ("target", "vote"):  # varchar to a longer varchar: no table rewrite
        op.alter_column("rollouts", column, existing_type=sa.String(64), type_=sa.String(256))


def downgrade() -> None:
    # unknown was recorded as valid, and labels were 64 characters, before this revision
    op.execute(sa.text("UPDATE rollouts SET format_valid = true WHERE format_valid IS NULL"))
    for column in ("target", "vote"):
        op.execute(
            sa.text(f"UPDATE rollouts SET {column} = substr({column}, 1, 64) WHERE length({column}) > 64")
        )
    if op.get_bind().dialect.name == "sqlite":
        _sqlite_schema([(new, old) for old, new in _SQLITE_EDITS])
        return
    op.alter_column("rollouts", "format_valid", existing_type=sa.Boolean(), nullable=False)
    for column in ("target", "vote"):
        op.alter_column("rollouts", column, existing_type=sa.String(256), type_=sa.String(64))
