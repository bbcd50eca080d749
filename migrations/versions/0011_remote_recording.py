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
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("record_key", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("recorded_by", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint("uq_runs_record_key", ["record_key"])
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("notify_state", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("notify_error", sa.Text(), nullable=True))
        batch_op.create_index("ix_alerts_notify_state", ["notify_state"], unique=False)
    # Alerts recorded before deliveries existed are not news: never sent.
    op.execute("UPDATE alerts SET notify_state = 'before'")


def downgrade() -> None:
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_index("ix_alerts_notify_state")
        batch_op.drop_column("notify_error")
        batch_op.drop_column("notify_state")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_constraint("uq_runs_record_key", type_="unique")
        batch_op.drop_column("recorded_by")
        batch_op.drop_column("record_key")
