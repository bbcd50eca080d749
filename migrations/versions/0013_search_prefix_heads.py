"""PostgreSQL: index each word's 3-character head, so that a 3-character prefix is one number

server.store.search now numbers, beside each word of at least 3 characters, its head: the key
`*` and its first 3 characters (`*` sorts before every letter and digit, so no prefix's range of
words holds one). A prefix of 3 characters is then that one number, looked up as a whole word
is, instead of a GIN scan for each of its words: `ves*` at 1,000 full steps stood for 11,575
words and took 0.9 s. This adds the heads of every numbered word to search_words and their
numbers to every rollout's and prompt's words. SQLite's FTS5 has its own prefix queries.

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
_TABLES = (("rollout_search", "ix_rollout_search_words"), ("prompt_search", "ix_prompt_search_words"))


def _rewrite(table: str, index: str, words: str) -> None:
    """Set every row's words to `words` (SQL of the row `t`), its GIN index built afresh after
    (one sorted build, not an entry at a time)."""
    op.execute(f"DROP INDEX {index}")
    op.execute(f"UPDATE {table} t SET words = {words}")
    op.execute(f"CREATE INDEX {index} ON {table} USING gin (words)")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"INSERT INTO search_words (word) SELECT DISTINCT '*' || left(word, {_HEAD}) "
        f"FROM search_words WHERE length(word) >= {_HEAD} AND left(word, 1) <> '*' "
        "ON CONFLICT (word) DO NOTHING"
    )
    # each word's number → its head's, looked up by the number (search_words is keyed by word)
    op.execute(
        "CREATE TEMPORARY TABLE head_of (word_id integer PRIMARY KEY, head_id integer NOT NULL)"
    )
    op.execute(
        "INSERT INTO head_of SELECT s.id, h.id FROM search_words s "
        f"JOIN search_words h ON h.word = '*' || left(s.word, {_HEAD}) "
        f"WHERE length(s.word) >= {_HEAD} AND left(s.word, 1) <> '*'"
    )
    op.execute("ANALYZE head_of")
    for table, index in _TABLES:
        _rewrite(
            table,
            index,
            "ARRAY(SELECT u.w FROM unnest(t.words) AS u(w) UNION SELECT h.head_id "
            "FROM unnest(t.words) AS u(w) JOIN head_of h ON h.word_id = u.w ORDER BY 1)",
        )
    op.execute("DROP TABLE head_of")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    heads = "SELECT id FROM search_words WHERE left(word, 1) = '*'"
    for table, index in _TABLES:
        _rewrite(
            table,
            index,
            f"ARRAY(SELECT u.w FROM unnest(t.words) AS u(w) WHERE u.w NOT IN ({heads}) ORDER BY 1)",
        )
    op.execute(f"DELETE FROM search_words WHERE id IN ({heads})")
