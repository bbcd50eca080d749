"""run source, dropped counts and recording notes

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 06:35:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('source', sa.String(length=16), server_default='launched', nullable=False)
        )
        batch_op.add_column(
            sa.Column('dropped_steps', sa.Integer(), server_default='0', nullable=False)
        )
        batch_op.add_column(
            sa.Column('dropped_rollouts', sa.Integer(), server_default='0', nullable=False)
        )
        batch_op.add_column(
            sa.Column('notes', sa.JSON(), server_default='[]', nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('notes')
        batch_op.drop_column('dropped_rollouts')
        batch_op.drop_column('dropped_steps')
        batch_op.drop_column('source')
