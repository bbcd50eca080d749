"""remote recording: a run's record key and the token that created it; alerts' webhook delivery

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 22:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Columns and indexes only, added in place: no table is rebuilt. On SQLite a rebuilt `runs`
    # (what batch mode does for a unique constraint) is dropped and copied, and with its foreign
    # keys on the drop empties steps, rollouts and alerts; a unique index has no such cost.
    op.add_column("runs", sa.Column("record_key", sa.String(length=64), nullable=True))
    op.add_column("runs", sa.Column("recorded_by", sa.String(length=64), nullable=True))
    op.create_index("uq_runs_record_key", "runs", ["record_key"], unique=True)
    op.add_column("alerts", sa.Column("notify_state", sa.String(length=16), nullable=True))
    op.add_column("alerts", sa.Column("notify_error", sa.Text(), nullable=True))
    op.create_index("ix_alerts_notify_state", "alerts", ["notify_state"], unique=False)
    # Alerts recorded before deliveries existed are not news: never sent.
    op.execute("UPDATE alerts SET notify_state = 'before'")


def downgrade() -> None:
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_index("ix_alerts_notify_state")
        batch_op.drop_column("notify_error")
        batch_op.drop_column("notify_state")
    op.drop_index("uq_runs_record_key", table_name="runs")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("recorded_by")
        batch_op.drop_column("record_key")
