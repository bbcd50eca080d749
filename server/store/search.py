"""Full-text search of completions and prompts, by the databases' own engines.

SQLite: an FTS5 table per run (`rollout_fts_<run id>`, contentless: it holds the index, not the
text, which the rollout's ids already hold), created with the run's first rollouts and dropped
with the run; `prompt_fts` indexes the prompts' text (contentless too: the prompts are stored
compressed, server.store.prompt_texts). PostgreSQL: `search_words` numbers each
distinct word once (its `word`, the primary key, in the "C" collation, so that a prefix is a
range of that index), and `rollout_search` holds each rollout's run and its words as a sorted
int4[] of those numbers under a GIN index; `prompt_search` the same for each prompt. A word
longer than MAX_WORD_CHARS, which no query may name whole, is numbered as its first
MAX_WORD_CHARS characters and a `*` (no word has one), which only a prefix finds. A word of at least
PREFIX_HEAD characters also adds its head's number: the key `*` and its first PREFIX_HEAD
characters, which no prefix's range of words holds (`*` sorts before every letter and digit), so
that a prefix of exactly PREFIX_HEAD characters is one number, looked up as a whole word is.

Both engines see the same words: runs of letters and digits, lower-cased (`_` and every other
character separates words), in the first SEARCH_CHARS characters of a completion (a prompt is
indexed whole on SQLite, in its first SEARCH_CHARS on PostgreSQL). A query is up to MAX_WORDS
words of at most MAX_WORD_CHARS characters (a longer one is refused, not cut), all of which must
appear; a word ending in `*` matches as a prefix.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format
from rollout_lens.server.core.distinct import distinct
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.textsafe import CLEAN_ALREADY
from rollout_lens.server.store import wordscan
from rollout_lens.server.store.arrays import completion
from sqlalchemy import Connection, text

SEARCH_CHARS = 200_000  # a longer completion is searchable in its first 200,000 characters
MAX_WORDS = 20  # a query's words, all of which must appear
MAX_WORD_CHARS = 200  # a longer word is refused, not cut (the runs page's search says the same)
MAX_QUERY_CHARS = 4096  # the text of a query: room for MAX_WORDS words of MAX_WORD_CHARS
# Distinct words a prefix may stand for on PostgreSQL: each is a GIN scan (_by_prefix), about
# 60 microseconds, and its matches a row read each (`ves*` at 1,000 full steps, 11,575 words and
# 138,709 matches: 0.7-0.9 s). A prefix of PREFIX_HEAD characters is one number instead, its
# head's (search_keys), found as a whole word is; only a shorter or a longer one is its words.
MAX_PREFIX_WORDS = 20_000
PREFIX_HEAD = 3
HEAD_MARK = "*"  # a head's key is the mark and the head (head_key)
COMMON_FROM = 20_000  # PostgreSQL: a search matching this many rollouts walks the sort order
# PostgreSQL: the GIN indexes of the rollouts' and the prompts' word numbers (migration 0010)
ROLLOUT_WORDS_INDEX, PROMPT_WORDS_INDEX = "ix_rollout_search_words", "ix_prompt_search_words"
RUN_PROMPTS_INDEX = "ix_rollouts_search_prompts"  # PostgreSQL: rollouts (run_id, prompt_id), 0016
_WORD = re.compile(r"[^\W_]+(\*?)")
_WORDS = re.compile(r"[^\W_]+")
_TOKENIZER = "unicode61 remove_diacritics 0"
# FTS5 merges a level's segments once it holds this many (its default: 4). A step's insert is a
# segment; merging 8 at a time rewrites each posting half as often: a full-shape step indexed in
# a fifth less time, a search of a run's few dozen segments as fast (docs/benchmarks/storage.md).
FTS_AUTOMERGE = 8


def fts_table(run_id: int) -> str:
    """The SQLite FTS5 table of one run's completions."""
    return f"rollout_fts_{int(run_id)}"


def words(text_: str) -> str:
    """The words search sees in a text: each distinct one once, lower-cased, space-separated —
    the rule both engines index by (they are handed `spaced`'s texts, the same words found for
    a whole step at once)."""
    return " ".join(dict.fromkeys(_WORDS.findall(text_[:SEARCH_CHARS].lower())))


def spaced(texts: Sequence[str]) -> list[str]:
    """Each text's words (`words`), lower-cased, between spaces where its other characters were:
    found for all the texts in one pass (wordscan), repeats and all (FTS5's detail=none index
    and a set keep each word once)."""
    return wordscan.spaced(texts, SEARCH_CHARS)


def parse_query(q: str) -> list[tuple[str, bool]]:
    """`q` → its words (lower-cased) and whether each is a prefix; refuses an empty or long one."""
    found = [(m.group(0).rstrip("*").lower(), bool(m.group(1))) for m in _WORD.finditer(q)]
    if not found:
        raise InvalidInput("q: give at least one word (letters or digits) to search for")
    if len(found) > MAX_WORDS:
        raise InvalidInput(f"q: at most {MAX_WORDS} words, got {len(found)}")
    longest = max(len(word) for word, _ in found)
    if longest > MAX_WORD_CHARS:
        raise InvalidInput(
            f"q: a word has at most {MAX_WORD_CHARS} characters, got one of {longest}"
        )
    return found


def fts5_query(terms: Sequence[tuple[str, bool]]) -> str:
    """Terms → an FTS5 MATCH expression: each quoted (no operator can be smuggled in), ANDed."""
    return " ".join(f'"{word}"' + ("*" if prefix else "") for word, prefix in terms)


def index_rollouts(
    conn: Connection,
    *,
    run_id: int,
    rows: Sequence[tuple[int, str]],
    words: WordNumbers | None = None,
) -> None:
    """Index (rollout id, completion text) pairs of one run (PostgreSQL: the word numbers
    `words` knows are not asked for again)."""
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        _index_postgres(conn, run_id, rows, words)
        return
    table = fts_table(run_id)
    if not has_index(conn, run_id=run_id):
        conn.exec_driver_sql(
            f"CREATE VIRTUAL TABLE {table} USING fts5("
            f"text, content='', detail=none, tokenize='{_TOKENIZER}')"
        )
        conn.exec_driver_sql(
            f"INSERT INTO {table} ({table}, rank) VALUES ('automerge', {FTS_AUTOMERGE})"
        )
    conn.exec_driver_sql(
        f"INSERT INTO {table} (rowid, text) VALUES (?, ?)",
        list(
            zip([rollout_id for rollout_id, _ in rows], spaced([t for _, t in rows]), strict=True)
        ),
        execution_options=CLEAN_ALREADY,  # words are letters and digits
    )


def word_key(word: str) -> str:
    """A word as search_words holds it: itself, or a long one's head and `*` (prefixes only)."""
    return word if len(word) <= MAX_WORD_CHARS else word[:MAX_WORD_CHARS] + "*"


def head_key(prefix: str) -> str:
    """The key of every word that starts with `prefix`, of PREFIX_HEAD characters."""
    return HEAD_MARK + prefix


def search_keys(found: Iterable[str]) -> set[str]:
    """A text's words as search_words keys: each word's (word_key) and, for a word of at least
    PREFIX_HEAD characters, its head's (head_key). The rule, and the tests' oracle: a step's
    rows are keyed in numpy passes (number_rows)."""
    keys = {word_key(w) for w in found}
    keys.update({head_key(w[:PREFIX_HEAD]) for w in found if len(w) >= PREFIX_HEAD})
    return keys


def word_numbers(conn: Connection, keys: set[str]) -> dict[str, int]:
    """PostgreSQL: each of these keys (search_keys) → its number in search_words, numbering the
    new ones."""
    wanted = sorted(keys)
    if not wanted:
        return {}
    # Only the words not numbered yet are offered: ON CONFLICT alone would draw an identity
    # value for every word offered (tens of thousands a step), not only for the new ones. The
    # new ones' numbers come back from the insert; only the others are looked up (a step of
    # the scale bench numbers some 32,000 new keys, whose look-up took 40 to 100 ms).
    numbers: dict[str, int] = {
        word: number
        for word, number in conn.exec_driver_sql(
            "INSERT INTO search_words (word) SELECT u.w FROM unnest(%s::text[]) AS u(w) "
            "WHERE NOT EXISTS (SELECT 1 FROM search_words s WHERE s.word = u.w) "
            "ON CONFLICT (word) DO NOTHING RETURNING word, id",
            (_keys_array(wanted),),
            execution_options=CLEAN_ALREADY,  # words are letters and digits
        )
    }
    known = [key for key in wanted if key not in numbers]
    if known:  # numbered before, or by a writer beside this one (ON CONFLICT waited for it)
        numbers.update(
            conn.exec_driver_sql(
                "SELECT word, id FROM search_words WHERE word = ANY(%s::text[])",
                (_keys_array(known),),
                execution_options=CLEAN_ALREADY,
            ).all()
        )
    return numbers


def _keys_array(keys: Sequence[str]) -> str:
    """search_words keys as one text[] literal, each quoted (a key is letters, digits and `*`:
    no `"` or `\\` to escape, and quoted, the word `null` is not a NULL): psycopg turning the
    list of a full-shape step's tens of thousands of keys into an array was a tenth of its
    indexing."""
    return '{"' + '","'.join(keys) + '"}'


class WordNumbers:
    """PostgreSQL: the search_words numbers one writer has used, so that a step asks the
    database only for the keys it has not numbered before (a run's words recur: at the scale
    bench's shape, numbering a step's tens of thousands of keys took a fifth of its indexing).
    A number never changes once committed (search_words only grows, nothing deletes from it);
    the ones found in a transaction that then fails are taken back (`discard`). A store
    Recorder keeps one for its rollouts' words (numbered as they are indexed) and its new
    prompts' (in the step's own transaction), and calls `begin` as its indexing starts: what
    it numbered before has committed, or the Recorder would have been thrown away
    (server.store.writing)."""

    LIMIT = 500_000  # keys kept (some 60 MB); past it they are asked for again

    def __init__(self) -> None:
        self.known: dict[str, int] = {}
        self._fresh: list[str] = []  # numbered in the transaction under way

    def begin(self) -> None:
        self._fresh = []

    def discard(self) -> None:
        """The transaction under way failed: its numbers are not the database's."""
        for key in self._fresh:
            self.known.pop(key, None)
        self._fresh = []

    def numbers(self, conn: Connection, keys: set[str]) -> dict[str, int]:
        """A mapping that holds each of `keys`' numbers (word_numbers), the new ones asked."""
        unknown = keys.difference(self.known)
        if len(self.known) + len(unknown) > self.LIMIT:
            self.known, self._fresh, unknown = {}, [], set(keys)
        if unknown:
            found = word_numbers(conn, unknown)
            self.known.update(found)
            self._fresh.extend(found)
        return self.known


class Int4s(NamedTuple):
    """Integers sent to PostgreSQL as an int4[] in its binary form, made by numpy in one pass
    (no Python int, str or list an element)."""

    values: np.ndarray


_INT4 = psycopg.postgres.types["int4"]


class _Int4sDumper(Dumper):
    oid = _INT4.array_oid
    format = Format.BINARY

    def dump(self, obj: Int4s) -> bytes:
        """PostgreSQL's binary array: dimensions, no nulls, the element type, the length and
        lower bound, then each element's length (4) and value, big-endian."""
        n = len(obj.values)
        if not n:
            return struct.pack(">iii", 0, 0, _INT4.oid)
        cells = np.empty((n, 2), dtype=">i4")
        cells[:, 0], cells[:, 1] = 4, obj.values
        return struct.pack(">iiiii", 1, 0, _INT4.oid, n, 1) + cells.tobytes()


psycopg.adapters.register_dumper(Int4s, _Int4sDumper)

# Rows' word numbers as one array and each row's slice of it, which PostgreSQL cuts out
_SLICED = (
    "FROM (SELECT %s::integer[] AS n) AS f, "
    "unnest(%s::integer[], %s::integer[], %s::integer[]) AS u(i, s, e)"
)


def number_rows(
    conn: Connection, rows: Sequence[tuple[int, str]], words: WordNumbers | None = None
) -> tuple[Int4s, Int4s, Int4s]:
    """PostgreSQL: each (id, text) row's keys (search_keys) as their numbers, sorted, numbering
    the new ones (those `words` knows are not asked for): every row's numbers end to end, and
    each row's first and last place among them (1-based, as an array's slice). A word's key and
    head are found once a step (each distinct word), and each row's numbers in numpy passes: a
    rollout's set of keys, its numbers sorted and written out as a literal were about 400 ms of
    the writer's Python a full-shape step."""
    found = [set(text_.split()) for text_ in spaced([t for _, t in rows])]
    seen = list(set().union(*found))
    keys = [word_key(w) for w in seen]
    heads = [head_key(w[:PREFIX_HEAD]) if len(w) >= PREFIX_HEAD else "" for w in seen]
    wanted = {*keys, *heads} - {""}
    numbers = word_numbers(conn, wanted) if words is None else words.numbers(conn, wanted)
    key_numbers = np.fromiter(map(numbers.__getitem__, keys), np.int64, len(keys))
    head_numbers = np.fromiter((numbers[h] if h else -1 for h in heads), np.int64, len(heads))
    place = dict(zip(seen, range(len(seen)), strict=True))
    counts = np.fromiter(map(len, found), np.int64, len(found))
    at = np.fromiter(map(place.__getitem__, chain.from_iterable(found)), np.int64, counts.sum())
    row = np.repeat(np.arange(len(found), dtype=np.int64), counts) << 32
    head = head_numbers[at]
    has = head >= 0
    keyed = distinct(np.concatenate((row | key_numbers[at], row[has] | head[has])))
    ends = np.searchsorted(keyed >> 32, np.arange(len(found)), side="right")
    starts = np.concatenate(([0], ends[:-1])) + 1
    flat = (keyed & 0xFFFFFFFF).astype(np.int32)
    return Int4s(flat), Int4s(starts.astype(np.int32)), Int4s(ends.astype(np.int32))


def _index_postgres(
    conn: Connection, run_id: int, rows: Sequence[tuple[int, str]], words: WordNumbers | None
) -> None:
    ids = [rollout_id for rollout_id, _ in rows]
    flat, starts, ends = number_rows(conn, rows, words)
    conn.exec_driver_sql(
        f"INSERT INTO rollout_search (rollout_id, run_id, words) SELECT u.i, %s, f.n[u.s:u.e] "
        f"{_SLICED}",
        (run_id, flat, ids, starts, ends),
        execution_options=CLEAN_ALREADY,  # numbers
    )
    merge_pending(conn, ROLLOUT_WORDS_INDEX)


def merge_pending(conn: Connection, index: str) -> None:
    """PostgreSQL: move a GIN index's pending list into its tree now.

    GIN (fastupdate, the default) queues new entries in a pending list of up to 4 MB — about
    one full step of rollouts here — that every search reads whole and checks against each of
    its word numbers until VACUUM or the next overflow merges it: 430 pages a search, 75 ms for
    a prefix of 490 words at 1,000 steps (10 ms merged), and on the prompts' tiny table the
    planner, costing those pages, chose to compare every prompt's words with every number
    (80 ms). Merging after each step's indexing costs the write what the overflow's merge would
    have cost it anyway, and searches between steps see no pending list. Only the index's owner
    may merge (as VACUUM); another role leaves it to autovacuum."""
    conn.exec_driver_sql(
        "SELECT gin_clean_pending_list(c.oid) FROM pg_class c "
        "WHERE c.oid = to_regclass(%s) AND pg_has_role(c.relowner, 'USAGE')",
        (index,),
    )


def index_prompts(
    conn: Connection, rows: Sequence[tuple[int, str]], words: WordNumbers | None = None
) -> None:
    """Index new prompts (SQLite: whole, in the contentless prompt_fts, which `forget_prompts`
    hands the same text to take one out; PostgreSQL: their words' numbers, as a completion's,
    those `words` knows not asked for)."""
    if rows and conn.dialect.name == "postgresql":
        flat, starts, ends = number_rows(conn, rows, words)
        conn.exec_driver_sql(
            f"INSERT INTO prompt_search (prompt_id, words) SELECT u.i, f.n[u.s:u.e] {_SLICED} "
            "ON CONFLICT DO NOTHING",
            (flat, [i for i, _ in rows], starts, ends),
            execution_options=CLEAN_ALREADY,  # numbers
        )
        merge_pending(conn, PROMPT_WORDS_INDEX)
    elif rows:
        conn.exec_driver_sql(
            "INSERT INTO prompt_fts (rowid, text) VALUES (?, ?)",
            [(prompt_id, t) for prompt_id, t in rows],
        )


def forget_prompts(conn: Connection, rows: Sequence[tuple[int, str]]) -> None:
    """Take prompts about to be deleted out of the index (SQLite needs their text to do so)."""
    if rows and conn.dialect.name != "postgresql":
        conn.exec_driver_sql(
            "INSERT INTO prompt_fts (prompt_fts, rowid, text) VALUES ('delete', ?, ?)",
            [(prompt_id, t) for prompt_id, t in rows],
        )


def forget_after(conn: Connection, *, run_id: int, step: int) -> None:
    """Take a run's rollouts after `step` out of its index, before they are deleted (a resume
    from a checkpoint): SQLite's contentless index needs each text to remove it."""
    if conn.dialect.name == "postgresql" or not has_index(conn, run_id=run_id):
        return
    rows = conn.exec_driver_sql(
        "SELECT r.id, r.text_rule, d.ids, d.text FROM rollouts r "
        "JOIN rollout_data d ON d.rollout_id = r.id WHERE r.run_id = ? AND r.step > ?",
        (run_id, step),
    ).all()
    if not rows:
        return
    texts: dict[int, str] = dict(
        conn.exec_driver_sql(
            "SELECT token_id, text FROM run_tokens WHERE run_id = ?", (run_id,)
        ).all()
    )
    table = fts_table(run_id)
    conn.exec_driver_sql(
        f"INSERT INTO {table} ({table}, rowid, text) VALUES ('delete', ?, ?)",
        list(
            zip(
                [rid for rid, *_ in rows],
                spaced([completion(rule, ids, text_, texts) for _, rule, ids, text_ in rows]),
                strict=True,
            )
        ),
    )


def unindexed(
    conn: Connection, *, run_id: int, token_texts: dict[int, str]
) -> list[tuple[int, str]]:
    """(rollout id, completion text) of a run's rollouts written after its newest indexed one:
    what a writer that stopped between a step's commit and its indexing left unsearchable (the
    store indexes in rollout id order, so every rollout below that one is indexed)."""
    postgres = conn.dialect.name == "postgresql"
    mark = "%s" if postgres else "?"
    newest = conn.exec_driver_sql(
        f"SELECT id FROM rollouts WHERE run_id = {mark} ORDER BY id DESC LIMIT 1", (run_id,)
    ).scalar()
    if newest is None:
        return []
    if postgres:
        indexed = conn.exec_driver_sql(
            "SELECT s.rollout_id FROM rollout_search s JOIN rollouts r ON r.id = s.rollout_id "
            "WHERE r.run_id = %s ORDER BY s.rollout_id DESC LIMIT 1",
            (run_id,),
        ).scalar()
    elif has_index(conn, run_id=run_id):
        indexed = conn.exec_driver_sql(
            f"SELECT rowid FROM {fts_table(run_id)} ORDER BY rowid DESC LIMIT 1"
        ).scalar()
    else:
        indexed = None
    if indexed is not None and indexed >= newest:
        return []
    rows = conn.exec_driver_sql(
        "SELECT r.id, r.text_rule, d.ids, d.text FROM rollouts r JOIN rollout_data d ON "
        f"d.rollout_id = r.id WHERE r.run_id = {mark} AND r.id > {mark} ORDER BY r.id",
        (run_id, indexed or 0),
    ).all()
    return [(rid, completion(rule, ids, text_, token_texts)) for rid, rule, ids, text_ in rows]


def drop_run(conn: Connection, *, run_id: int) -> None:
    """A deleted run's index goes with it (PostgreSQL's rows cascade with the rollouts)."""
    if conn.dialect.name != "postgresql":
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {fts_table(run_id)}")


def has_index(conn: Connection, *, run_id: int) -> bool:
    """Whether the run has completions indexed (SQLite: its FTS table exists)."""
    if conn.dialect.name == "postgresql":
        return True
    found = conn.execute(
        text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name"),
        {"name": fts_table(run_id)},
    ).first()
    return found is not None


class Match(NamedTuple):
    """match_sql's answer: a SQL condition on a rollouts row aliased `r`, its parameters, and,
    where the index alone says it, how many of the run's rollouts it holds for (else None)."""

    sql: str
    params: dict[str, Any]
    total: int | None


def match_sql(conn: Connection, *, run_id: int, q: str) -> Match:
    """The condition that a rollouts row `r` of the run has every word of `q` in its completion
    or its prompt.

    The prompts that match are found first. On PostgreSQL, where they are every prompt of the
    run, every rollout of the run matches (no condition), and the completions' index is not read (a word of
    the prompts' template is in all of them: `need*` at 100 full steps read 69,092 rollouts' ids
    in 74 ms that no row needed). Otherwise the condition is also a lookup of the index's
    rollout ids, which the database reads from the index instead of testing every rollout of the
    run. On PostgreSQL, where no prompt matches and the run's matches are read from the index
    as ids, their number is the count (a filter-free page need not count them again: `vest*` at
    1,000 full steps, 76,422 ids tested against the run's 512,000 rollouts, took 103 of its 307
    ms)."""
    terms = parse_query(q)
    postgres = conn.dialect.name == "postgresql"
    numbers: dict[str, list[int]] = {}
    if postgres:
        known = _postgres_terms(conn, terms)
        if known is None:
            return Match("(0 = 1)", {}, 0)
        numbers = known
        with _index_scans(conn) if _prefixes(numbers) else nullcontext():
            prompt_ids = conn.execute(text(_prompts(numbers)), numbers).scalars().all()
    else:
        prompt_ids = (
            conn.execute(
                text("SELECT rowid FROM prompt_fts WHERE prompt_fts MATCH :q"),
                {"q": fts5_query(terms)},
            )
            .scalars()
            .all()
        )
    # The matching prompts as one parameter however many they are (a dataset's every prompt can
    # hold a common word): PostgreSQL's an integer array, SQLite's the prompts' index again (a
    # subquery it evaluates once), where a mark a prompt would meet SQLite's variable limit.
    by_prompt: dict[str, Any]
    if postgres:
        prompts_sql = "r.prompt_id = ANY(CAST(:prompt_ids AS integer[]))"
        by_prompt = {"prompt_ids": list(prompt_ids)}
    else:
        prompts_sql = (
            "r.prompt_id IN (SELECT rowid FROM prompt_fts WHERE prompt_fts MATCH :prompt_words)"
        )
        by_prompt = {"prompt_words": fts5_query(terms)}
    if prompt_ids and postgres and _all_prompts(conn, run_id, by_prompt["prompt_ids"]):
        # every rollout of the run matches: the page is the run's, without a condition (a
        # dataset's 5,000 prompts as one array took `need` at 1,000 steps to 221 ms)
        return Match("(1 = 1)", {}, None)
    total: int | None = None
    if postgres:
        rollouts, params, total = _postgres_rollouts(conn, run_id, numbers)
    else:
        rollouts, params = _sqlite_rollouts(conn, run_id, terms)
    if not prompt_ids:
        return Match(f"({rollouts})", params, total)
    # The prompts first: a row whose prompt has the words needs no look at its own
    return Match(f"({prompts_sql} OR {rollouts})", params | by_prompt, None)


def _sqlite_rollouts(conn: Connection, run_id: int, terms: Any) -> tuple[str, dict[str, Any]]:
    """SQLite's condition that a rollout's completion has the words: its id in the run's index."""
    table = fts_table(run_id)
    rollouts = (
        f"r.id IN (SELECT rowid FROM {table} WHERE {table} MATCH :search)"
        if has_index(conn, run_id=run_id)
        else "0 = 1"
    )
    return rollouts, {"search": fts5_query(terms)}


def prompt_match_sql(conn: Connection, *, q: str, column: str) -> Match:
    """The condition that the prompt whose id is `column` has every word of `q` (the explorer's
    words, read in the prompts' index alone): for the prompt lens, whose rows are prompts."""
    terms = parse_query(q)
    if conn.dialect.name != "postgresql":
        return Match(
            f"({column} IN (SELECT rowid FROM prompt_fts WHERE prompt_fts MATCH :prompt_words))",
            {"prompt_words": fts5_query(terms)},
            None,
        )
    numbers = _postgres_terms(conn, terms)
    if numbers is None:
        return Match("(0 = 1)", {}, 0)
    with _index_scans(conn) if _prefixes(numbers) else nullcontext():
        found = conn.execute(text(_prompts(numbers)), numbers).scalars().all()
    return Match(
        f"({column} = ANY(CAST(:prompt_ids AS integer[])))", {"prompt_ids": list(found)}, None
    )


def _all_prompts(conn: Connection, run_id: int, prompt_ids: list[int]) -> bool:
    """PostgreSQL: whether every rollout of the run has one of these prompts: the run's
    distinct prompts, read in order from RUN_PROMPTS_INDEX one look-up each (a loose index
    scan), until one is not among them — at most one more look-up than there are prompts,
    however many rollouts the run has."""
    first = "SELECT prompt_id FROM rollouts WHERE run_id = :cover_run"
    walk = (
        f"WITH RECURSIVE p(id) AS (SELECT ({first} ORDER BY prompt_id LIMIT 1) UNION ALL "
        f"SELECT ({first} AND prompt_id > p.id ORDER BY prompt_id LIMIT 1) FROM p "
        "WHERE p.id IS NOT NULL) SELECT 1 FROM p "
        "WHERE p.id <> ALL(CAST(:cover_prompts AS integer[])) LIMIT 1"
    )
    found = conn.execute(text(walk), {"cover_run": run_id, "cover_prompts": prompt_ids})
    return found.first() is None


def _prefix_end(prefix: str) -> str:
    """The first text past every text that starts with `prefix`, in code point order (the "C"
    collation's order for UTF-8): its last character one higher."""
    after = ord(prefix[-1]) + 1
    return prefix[:-1] + chr(0xE000 if 0xD800 <= after < 0xE000 else after)  # no surrogate


def _postgres_terms(
    conn: Connection, terms: Sequence[tuple[str, bool]]
) -> dict[str, list[int]] | None:
    """PostgreSQL: the terms' numbers as parameters — `search_all` every whole word's and every
    head's (a prefix of PREFIX_HEAD characters), `search_any<i>` those of each other prefix's
    words — or None when a term is no indexed word (nothing can match)."""
    whole = {word for word, prefix in terms if not prefix}
    whole |= {head_key(word) for word, prefix in terms if prefix and len(word) == PREFIX_HEAD}
    numbers = word_numbers_known(conn, sorted(whole))
    if len(numbers) < len(whole):
        return None
    params: dict[str, list[int]] = {}
    if numbers:
        params["search_all"] = sorted(numbers.values())
    others = {word for word, prefix in terms if prefix and len(word) != PREFIX_HEAD}
    for i, prefix in enumerate(sorted(others)):
        found = (
            conn.execute(
                text(
                    "SELECT id FROM search_words WHERE word >= :lo AND word < :hi "
                    "ORDER BY word LIMIT :n"
                ),
                {"lo": prefix, "hi": _prefix_end(prefix), "n": MAX_PREFIX_WORDS + 1},
            )
            .scalars()
            .all()
        )
        if not found:
            return None
        if len(found) > MAX_PREFIX_WORDS:
            raise InvalidInput(
                f"q: {prefix}* stands for more than {MAX_PREFIX_WORDS:,} words; "
                "give more of the word"
            )
        params[f"search_any{i}"] = sorted(found)
    return params


_ALL = "CAST(:search_all AS integer[])"  # every whole word's and head's number (_postgres_terms)


def _has_all(alias: str, *, shown: bool = False) -> str:
    """A row `alias`'s words hold every whole word's number (`@>`), the numbers hidden from the
    planner (_hidden) unless `shown`."""
    return f"{alias}.words OPERATOR(pg_catalog.@>) {_ALL if shown else _hidden(_ALL)}"


def _prefixes(params: dict[str, list[int]]) -> list[str]:
    """The parameters of a query's prefixes (each its words' numbers)."""
    return sorted(name for name in params if name != "search_all")


def _has_prefix(alias: str, name: str) -> str:
    """A row `alias`'s words hold one of prefix `name`'s numbers: a look-up of each of its words
    in them (a constant array, which PostgreSQL hashes), not `&&`, which compares every pair."""
    return (
        f"EXISTS (SELECT 1 FROM unnest({alias}.words) AS {alias}_u(w) "
        f"WHERE {alias}_u.w = ANY(CAST(:{name} AS integer[])))"
    )


def _prompts(params: dict[str, list[int]]) -> str:
    """SQL of the prompts whose words have every term: with a prefix, the bitmap scan of its
    words that _by_prefix makes of the rollouts' (run under _index_scans: on this small table
    the planner would test every prompt against every word, 493 ms for 6,357 words and 256
    prompts), else a GIN scan of the whole words' numbers; the other terms checked on the
    prompts found. A look-up of each prompt's words in the prefix's (_has_prefix, for every
    prompt) cost 22-30 ms at 181 prompts for 13 to 9,416 words; the bitmap scan 0.1-17 ms."""
    prefixes = _prefixes(params)
    conds = [_any_of_prefix("s", prefixes[0])] if prefixes else []
    conds += [_has_all("s")] if "search_all" in params else []
    conds += [_has_prefix("s", name) for name in prefixes[1:]]
    return f"SELECT s.prompt_id FROM prompt_search s WHERE {' AND '.join(conds)}"


def _whole_words() -> str:
    """SQL of the run's rollout ids whose words have every whole word: one GIN scan of their
    numbers (every run's matches, the run's kept)."""
    return (
        f"SELECT t.rollout_id FROM rollout_search t WHERE {_has_all('t')} "
        "AND t.run_id = :search_run"
    )


def _among(params: dict[str, list[int]]) -> str:
    """SQL of those of the rollouts `:search_among` (ids) that have every prefix."""
    checks = [_has_prefix("t", name) for name in _prefixes(params)]
    return (
        "SELECT t.rollout_id FROM rollout_search t WHERE t.rollout_id = ANY(:search_among) "
        f"AND {' AND '.join(checks)}"
    )


def _by_prefix(params: dict[str, list[int]]) -> str:
    """SQL of the run's rollout ids that have every term, each once: one bitmap scan of the GIN
    index for the words of the first prefix (`words @> ANY(terms)`, one one-number search_term
    array a word, whose scans PostgreSQL ORs into one bitmap before it reads a row), with the
    whole words' numbers as a second condition and the run and the other prefixes checked on
    the rows found.

    Not `&&` over the prefix's numbers: GIN's scan of a key of n entries looks at all n for each
    match it returns, and `ves*` at 1,000 full steps (11,575 words over 120,707 rollouts) took
    8 s. Nor a lateral join over the numbers, a bitmap heap scan a word: that reads a row once
    for each of its words that match, and drops the repeats afterwards (`vest*`, 6,888 words at
    1,000 full steps: 143 ms for the scans and the distinct ids). The terms are hidden from the
    planner, which would cost them as that many rows each and read the table whole."""
    first, *others = _prefixes(params)
    conds = [_any_of_prefix("p", first), "p.run_id = :search_run"]
    if "search_all" in params:
        conds.append(_has_all("p"))
    conds += [_has_prefix("p", name) for name in others]
    return f"SELECT p.rollout_id FROM rollout_search p WHERE {' AND '.join(conds)}"


def _any_of_prefix(alias: str, name: str) -> str:
    """A row `alias`'s words hold one of prefix `name`'s numbers, as GIN answers it in one
    bitmap scan: `@>` one of one-number search_term arrays, hidden from the planner."""
    terms = (
        f"ARRAY(SELECT CAST(ARRAY[u.w] AS search_term) FROM unnest(CAST(:{name} AS integer[])) "
        "AS u(w))"
    )
    hidden = f"CAST({_hidden(terms)} AS search_term[])"  # not ANY((SELECT …)): a sub-query's rows
    return f"{alias}.words OPERATOR(pg_catalog.@>) ANY({hidden})"


def _hidden(value: str) -> str:
    """A value the planner reads as an unknown (a sub-select's), not as its constant."""
    return f"(SELECT {value})"


class IdsText(str):
    """Ids as the text of an int4[] (`{1,2,3}`), sent to PostgreSQL as an int4[] parameter: the
    planner then sees a constant array, which it hashes for `= ANY` (cast from text it is an
    expression, tested against every row one element at a time: 18 s for 72,000 ids), and
    psycopg need not turn a Python list of them into one (80 ms for 72,000)."""


class _IdsTextDumper(Dumper):
    oid = psycopg.postgres.types["int4"].array_oid

    def dump(self, obj: str) -> bytes:
        return obj.encode()


psycopg.adapters.register_dumper(IdsText, _IdsTextDumper)


def _ids(
    conn: Connection,
    sql: str,
    params: dict[str, Any],
    limit: int | None = None,
) -> tuple[int, IdsText]:
    """How many of the keys `sql` finds (its first `limit`, or all), and them sorted, as one
    array (20,000 rows cost more to fetch than to find) in the text that the statements using
    them take back as it is (IdsText)."""
    tail, extra = ("", {}) if limit is None else (" LIMIT :probe", {"probe": limit})
    n, found = conn.execute(
        text(
            "SELECT coalesce(cardinality(a.k), 0), a.k::text FROM "
            f"(SELECT array_agg(m.k ORDER BY m.k) FROM ({sql}{tail}) AS m(k)) AS a(k)"
        ),
        params | extra,
    ).one()
    return n, IdsText(found or "{}")


@contextmanager
def _index_scans(conn: Connection) -> Iterator[None]:
    """PostgreSQL: the statements inside planned with sequential scans off, the setting put back
    after them (the page's other statements are planned as before).

    For a prefix's bitmap scan (_any_of_prefix) on a small table: PostgreSQL costs a sequential
    scan by the table's few pages, not by the words it reads, which are TOASTed, and `@> ANY`
    reads a row's words again for each term, so that scan reads each row's words as many times
    as the prefix has words (a 1,000-word prefix over a run of 2,048 rollouts: 10.6 s; through
    the GIN index 0.2 s). PostgreSQL has no hint for one statement, so this is a setting local
    to the transaction (set_config's `true`). It is not put back after an error: the rollback
    (of the transaction or to a savepoint before it) undoes it."""
    before = conn.execute(
        text("SELECT current_setting('enable_seqscan'), set_config('enable_seqscan', 'off', true)")
    ).scalar()
    yield
    conn.execute(text("SELECT set_config('enable_seqscan', :before, true)"), {"before": before})


def _postgres_rollouts(
    conn: Connection, run_id: int, params: dict[str, list[int]]
) -> tuple[str, dict[str, Any], int | None]:
    """The rollouts half of match_sql on PostgreSQL, and how many of the run's rollouts it
    holds for when that is known. The run's matches' rollout ids are read once through the GIN
    index — whole words' up to COMMON_FROM: fewer, and the condition is those ids (the count and
    the page then read no index of words again), their number the count; as many, and it is a
    correlated EXISTS whose frequency the planner knows, so a page walks the sort order and
    stops at its end instead of reading every match's row (tens of thousands).

    A prefix's matches are always the ids, found all at once (testing a row for a prefix looks
    up each of its hundreds of words, and a count of 100,000 would do it for every row walked):
    among the whole words' matches when those are fewer than COMMON_FROM, else _by_prefix."""
    run = {"search_run": run_id}
    whole = {"search_all": params["search_all"]} if "search_all" in params else {}
    n, found = 0, IdsText("{}")
    if whole:
        n, found = _ids(conn, _whole_words(), whole | run, COMMON_FROM)
    if len(params) > len(whole):  # a prefix
        if not whole or n >= COMMON_FROM:
            with _index_scans(conn):
                n, found = _ids(conn, _by_prefix(params), params | run)
        elif n:
            n, found = _ids(conn, _among(params), params | {"search_among": found})
    elif n >= COMMON_FROM:
        shown = _has_all("s", shown=True)
        return (
            f"EXISTS (SELECT 1 FROM rollout_search s WHERE s.rollout_id = r.id AND {shown})",
            dict(params),
            None,
        )
    if not n:
        return "0 = 1", {}, 0
    return "r.id = ANY(:search_ids)", {"search_ids": found}, n


def word_numbers_known(conn: Connection, found: Sequence[str]) -> dict[str, int]:
    """PostgreSQL: the numbers of those of these words that search_words has (none added)."""
    if not found:
        return {}
    rows = conn.execute(
        text("SELECT word, id FROM search_words WHERE word = ANY(CAST(:w AS text[]))"),
        {"w": list(found)},
    ).all()
    return {word: number for word, number in rows}
