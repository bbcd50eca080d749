"""format_valid may be unknown: a run whose recorder had no format_valid function stores NULL

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


def upgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.alter_column("format_valid", existing_type=sa.Boolean(), nullable=True)


def downgrade() -> None:
    # unknown was recorded as valid before this revision
    op.execute(sa.text("UPDATE rollouts SET format_valid = true WHERE format_valid IS NULL"))
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.alter_column("format_valid", existing_type=sa.Boolean(), nullable=False)
