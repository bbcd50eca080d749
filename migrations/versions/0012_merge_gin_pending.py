"""PostgreSQL: merge the search indexes' GIN pending lists, which the store now merges after
each step it indexes (server.store.search.merge_pending)

A database written before this holds up to 4 MB of queued entries in each of them (on the
prompts' index every prompt ever indexed: it never overflowed), which every search read whole
until a VACUUM. Nothing else changes; SQLite has no such list.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 05:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for index in ("ix_rollout_search_words", "ix_prompt_search_words"):
        # the owner only, as VACUUM: another role's migration leaves it to autovacuum
        op.execute(
            "SELECT gin_clean_pending_list(c.oid) FROM pg_class c "
            f"WHERE c.oid = to_regclass('{index}') AND pg_has_role(c.relowner, 'USAGE')"
        )


def downgrade() -> None:
    pass  # nothing to undo: the entries are the same, in the tree instead of the list
