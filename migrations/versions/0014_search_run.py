"""PostgreSQL: each rollout_search row holds its rollout's run

server.store.search now writes a rollout's run beside its words and keeps only the searched run's
rows of a GIN scan, so that the ids it reads are that run's matches and their number is the
count of a search with no other filter: the explorer counted them again by testing each of the
run's rollouts against them (`vest*` at 1,000 full steps: 103 of its 307 ms). This copies every
row's run from rollouts, with the words' GIN index dropped first and built afresh after (the
rewritten rows are new row versions, and the index would otherwise take every word of each one
again, an entry at a time). The old versions are dead until a VACUUM or autovacuum takes them.
SQLite's FTS5 tables are one a run already.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 19:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("SET LOCAL maintenance_work_mem = '256MB'")  # as 0013: one sorted build in memory
    op.execute("ALTER TABLE rollout_search ADD COLUMN run_id integer")
    op.execute("DROP INDEX ix_rollout_search_words")
    op.execute(
        "UPDATE rollout_search t SET run_id = r.run_id FROM rollouts r WHERE r.id = t.rollout_id"
    )
    op.execute("ALTER TABLE rollout_search ALTER COLUMN run_id SET NOT NULL")
    op.execute("CREATE INDEX ix_rollout_search_words ON rollout_search USING gin (words)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE rollout_search DROP COLUMN run_id")
