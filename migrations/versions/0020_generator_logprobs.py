"""The generator's per-token logprobs beside the trainer's (issue 47): a rollout's data row gains
`generator_logprobs`, coded as `logprobs` is (server.store.arrays); NULL where the generation
path gave none, as it is for every rollout recorded before.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05 16:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Added in place on SQLite too (ALTER TABLE ADD COLUMN): a batch would rebuild rollout_data.
    op.add_column("rollout_data", sa.Column("generator_logprobs", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollout_data") as batch:
        batch.drop_column("generator_logprobs")
