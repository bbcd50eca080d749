"""Runs recorded over HTTP: a recorder's epoch (a resumed trainer's), and who ended a run

`record_epoch` goes up by one each time a trainer resumes its run from a checkpoint
(/api/record/runs with `resume_step`): a body of steps sent under an older epoch comes from the
process that the resume replaced, and is refused. `ended_by` says who ended a run that is no
longer running: the recorder that finished it, the dashboard's cancel (and whose token), or the
sweeper that found its heartbeats stopped (the only end a recorder's heartbeat may undo).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 18:35:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Added in place on SQLite too (ALTER TABLE ADD COLUMN): a batch would rebuild `runs`.
    op.add_column(
        "runs", sa.Column("record_epoch", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("runs", sa.Column("ended_by", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("ended_by")
        batch.drop_column("record_epoch")
