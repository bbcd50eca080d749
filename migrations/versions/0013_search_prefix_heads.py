"""PostgreSQL: index each word's 3-character head, so that a 3-character prefix is one number

server.store.search now numbers, beside each word of at least 3 characters, its head: the key
`*` and its first 3 characters (`*` sorts before every letter and digit, so no prefix's range of
words holds one). A prefix of 3 characters is then that one number, looked up as a whole word
is, instead of a GIN scan for each of its words: `ves*` at 1,000 full steps stood for 11,575
words and took 0.9 s. This adds the heads of every numbered word to search_words and their
numbers to every rollout's and prompt's words (51,200 full-shape rollouts: 135 s on two cores;
back, 72 s before it set maintenance_work_mem; the rewritten rows' old versions are dead until
a VACUUM or autovacuum takes them). SQLite's FTS5 has its own prefix queries.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 07:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_HEAD = 3  # server.store.search.PREFIX_HEAD when 0013 was written
_TABLES = (
    ("rollout_search", "ix_rollout_search_words"),
    ("prompt_search", "ix_prompt_search_words"),
)


def _rewrite(sql: str) -> None:
    """Run `sql`, which rewrites both tables' words, with their GIN indexes dropped first and
    built afresh after (one sorted build each, not an entry at a time), in memory enough to sort
    their entries (the default 64 MB spills: 62 s → 48 s for 51,200 full-shape rollouts)."""
    op.execute("SET LOCAL maintenance_work_mem = '256MB'")
    for _, index in _TABLES:
        op.execute(f"DROP INDEX {index}")
    op.execute(sql)
    for table, index in _TABLES:
        op.execute(f"CREATE INDEX {index} ON {table} USING gin (words)")


def _set_words(words: str) -> str:
    """Both tables' UPDATEs setting every row's words to `words` (SQL of the row `t`)."""
    return " ".join(f"UPDATE {table} t SET words = {words};" for table, _ in _TABLES)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"INSERT INTO search_words (word) SELECT DISTINCT '*' || left(word, {_HEAD}) "
        f"FROM search_words WHERE length(word) >= {_HEAD} AND left(word, 1) <> '*' "
        "ON CONFLICT (word) DO NOTHING"
    )
    # Each word's number → its head's (0: none), as an array indexed by the number and held in
    # a PL/pgSQL variable, so that a row's lookups are subscripts: an index probe each (a join
    # with a table of them) took 3.5 ms a full-shape row, this 1 ms.
    _rewrite(
        "DO $$ DECLARE head integer[]; BEGIN "
        "SELECT array_agg(coalesce(h.id, 0) ORDER BY n) INTO head "
        "FROM generate_series(1, (SELECT max(id) FROM search_words)) AS n "
        "LEFT JOIN search_words s ON s.id = n "
        f"LEFT JOIN search_words h ON length(s.word) >= {_HEAD} AND left(s.word, 1) <> '*' "
        f"AND h.word = '*' || left(s.word, {_HEAD}); "
        + _set_words(
            "ARRAY(SELECT u.w FROM unnest(t.words) AS u(w) UNION SELECT head[u.w] "
            "FROM unnest(t.words) AS u(w) WHERE head[u.w] > 0 ORDER BY 1)"
        )
        + " END $$"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    heads = "SELECT id FROM search_words WHERE left(word, 1) = '*'"
    _rewrite(
        _set_words(
            f"ARRAY(SELECT u.w FROM unnest(t.words) AS u(w) WHERE u.w NOT IN ({heads}) ORDER BY 1)"
        )
    )
    op.execute(f"DELETE FROM search_words WHERE id IN ({heads})")
