"""PostgreSQL: the `search_term` domain (an integer[]), so that a prefix is one bitmap scan

server.store.search finds a prefix's rollouts as `words @> ANY(terms)`, with `terms` an array
of one-number search_term arrays, one a word the prefix stands for: PostgreSQL scans the GIN
index once for each of them into one bitmap and reads each matching row once, where a lateral
join over the words ran a bitmap heap scan a word and read a row once for each of its words
that matched. An array's elements cannot be arrays, but they can be a domain over one. Nothing
else changes; SQLite has no such type.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 02:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE DOMAIN search_term AS integer[]")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP DOMAIN search_term")
