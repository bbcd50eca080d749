"""PostgreSQL's search by word numbers (migration 0010 and server.store.search): a database
indexed by the tsvectors of 0006 keeps every word its rollouts were found by; prefixes, words
longer than a query may name, and letters past ASCII find on both databases what a brute-force
scan of the texts finds."""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store import search
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import downgrade, upgrade
from rollout_lens.server.store.models import PromptGroupRow, RunPromptRow
from rollout_lens.server.store.recording import sha256_text
from rollout_lens.server.webapp import queries
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from tests.conftest import PG_URL
from tests.sql_support import executed

VOCAB = ["straße", "über", "überweg", "zebra", "zeal", "x1y2", "a" * 201, "tool", "07", "ǅemal"]
VOCAB += ["zeb", "str"]  # words that are their own heads (search.PREFIX_HEAD characters)
VOCAB += ["null", "NULL"]  # an unquoted NULL in an array literal is no word but a NULL


def _steps(
    rng: random.Random, steps: range, prompts: tuple[str, ...] = ("Pick one: prompt words only",)
) -> list[StepRecord]:
    """Steps of 6 rollouts of VOCAB's words, the i-th rollout in group i % len(prompts) with
    that group's prompt."""
    out = []
    for step in steps:
        rollouts = []
        for index in range(6):
            words = [rng.choice(VOCAB) for _ in range(rng.randrange(1, 6))]
            text_ = "_".join(words) if index % 2 else " ".join(w.title() for w in words)
            rollouts.append(
                RolloutRecord(
                    group=index % len(prompts),
                    index=index,
                    prompt=prompts[index % len(prompts)],
                    completion=text_,
                    completion_ids=list(range(len(words))),
                    token_logprobs=[-0.1] * len(words),
                    control_probs={},
                    vote=None,
                    target="tool",
                    verifier_reward=0.0,
                    true_score=0.0,
                    advantage=0.0,
                    format_valid=True,
                    format_state="healthy_call",
                )
            )
        out.append(StepRecord(step, step, {"reward_mean": 0.0}, rollouts))
    return out


def _write(factory: sessionmaker[Session], steps: list[StepRecord], *, index: bool) -> int:
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name="words", model="m", total_steps=len(steps), group_size=6
        ).id
        store.write_steps(
            session.connection(), None, steps, run_id=run_id, control_tokens=(), index=index
        )
    return run_id


def _has_all(text_: str, q: str) -> bool:
    """Whether a text's words have every term of `q` (a term ending in `*` as a prefix)."""
    words = {w.lower() for w in re.findall(r"[^\W_]+", text_)}
    return all(
        any(w.startswith(t[:-1]) for w in words) if t.endswith("*") else t in words
        for t in re.findall(r"[^\W_]+\*?", q.lower())
    )


def _expected(steps: list[StepRecord], q: str) -> set[tuple[int, int]]:
    """The (step, index) of each rollout whose completion, or whose prompt, has every term."""
    return {
        (record.step, r.index)
        for record in steps
        for r in record.rollouts
        if _has_all(r.completion, q) or _has_all(r.prompt, q)
    }


def _found(factory: sessionmaker[Session], run_id: int, q: str) -> set[tuple[int, int]]:
    """The run's rollouts that `q` finds, each once and as many as the page's total says."""
    with session_scope(factory) as session:
        page = queries.explore(session, run_id=run_id, query=queries.RolloutQuery(q=q, limit=200))
    assert page["next"] is None
    found = [(r["step"], r["index"]) for r in page["rollouts"]]
    assert (page["total"], page["total_capped"]) == (len(found), False)
    assert len(set(found)) == len(found)
    return set(found)


QUERIES = ["über", "ÜBER*", "zeal zebra", "ze*", "x1y2", "07", "straße", "ǆemal", "tool*", "a*"]
# a prefix with a whole word, and two prefixes (one found by the other's scans, on PostgreSQL)
QUERIES += ["zebra über*", "ze* tool*", "über* ze* zeal"]
# prefixes of search.PREFIX_HEAD characters (one number each on PostgreSQL), alone and mixed
QUERIES += ["zeb*", "ÜBE*", "str*", "aaa*", "ǅem*", "x1y*", "zeb* zeal", "zea* ze* tool*", "qqq*"]
QUERIES += ["null", "nul*", "null zeal"]


@pytest.mark.parametrize("q", QUERIES)
def test_search_finds_what_a_scan_finds(session_factory: sessionmaker[Session], q: str) -> None:
    """Each of two runs of the same words finds its own matches, and counts them alone."""
    steps = [_steps(random.Random(seed), range(1, 5)) for seed in (3, 4)]
    runs = [_write(session_factory, each, index=True) for each in steps]
    for run_id, each in zip(runs, steps, strict=True):
        assert _found(session_factory, run_id, q) == _expected(each, q)


def test_a_runs_fts5_index_merges_eight_segments_at_a_time(
    session_factory: sessionmaker[Session],
) -> None:
    """SQLite: a run's table is made with FTS5's automerge at search.FTS_AUTOMERGE (its own
    default, 4, rewrote each posting twice as often), and it stays so as steps are added."""
    engine = session_factory.kw["bind"]
    if engine.dialect.name == "postgresql":
        pytest.skip("FTS5 is SQLite's")
    run_id = _write(session_factory, _steps(random.Random(3), range(1, 3)), index=True)
    with engine.connect() as conn:
        config = f"{search.fts_table(run_id)}_config"
        merge = conn.execute(text(f"SELECT v FROM {config} WHERE k = 'automerge'")).scalar()
    assert merge == search.FTS_AUTOMERGE == 8
    assert _found(session_factory, run_id, "tool") == _expected(
        _steps(random.Random(3), range(1, 3)), "tool"
    )


def test_a_word_longer_than_a_query_is_numbered_by_its_head(engine: Engine) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("word numbers are PostgreSQL's")
    factory = make_session_factory(engine)
    steps = _steps(random.Random(3), range(1, 4))
    long_word = "a" * (search.MAX_WORD_CHARS + 1)
    assert any(long_word in r.completion.lower() for s in steps for r in s.rollouts)
    _write(factory, steps, index=True)
    with engine.connect() as conn:
        longest = conn.execute(text("SELECT max(length(word)) FROM search_words")).scalar()
        assert longest == search.MAX_WORD_CHARS + 1  # its head and `*`
        # numbers are drawn for new words only: writing the same words again draws none
        before = conn.execute(text("SELECT max(id) FROM search_words")).scalar()
    _write(factory, _steps(random.Random(3), range(1, 4)), index=True)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT max(id) FROM search_words")).scalar() == before


def test_a_prefix_standing_for_too_many_words_is_refused(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("FTS5 takes any prefix")
    factory = make_session_factory(engine)
    run_id = _write(factory, _steps(random.Random(3), range(1, 3)), index=True)
    monkeypatch.setattr(search, "MAX_PREFIX_WORDS", 1)
    with pytest.raises(InvalidInput, match="give more of the word"):
        _found(factory, run_id, "ze*")


def test_a_prefix_of_a_head_is_one_number_however_many_words(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`zeb*` (zeb, zebra) is its head's number on PostgreSQL, not its words: a cap of one word
    a prefix refuses `ze*` and `über*` (über, überweg), shorter and longer, not `zeb*`."""
    if engine.dialect.name != "postgresql":
        pytest.skip("heads are PostgreSQL's")
    factory = make_session_factory(engine)
    steps = _steps(random.Random(3), range(1, 3))
    run_id = _write(factory, steps, index=True)
    monkeypatch.setattr(search, "MAX_PREFIX_WORDS", 1)
    assert _found(factory, run_id, "zeb*") == _expected(steps, "zeb*") != set()
    for q in ("ze*", "über*"):
        with pytest.raises(InvalidInput, match="give more of the word"):
            _found(factory, run_id, q)


@contextmanager
def _fresh_pg(revision: str) -> Iterator[Engine]:
    """A fresh PostgreSQL database migrated to `revision`, dropped after."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"rollout_lens_{revision}_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(make_url(PG_URL).set(database=name).render_as_string(False))
    try:
        upgrade(engine, revision)
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_0009() -> Iterator[Engine]:
    """A fresh PostgreSQL database migrated to 0009 (a tsvector per rollout)."""
    with _fresh_pg("0009") as engine:
        yield engine


def _arrays(engine: Engine) -> dict[tuple[str, int], set[str]]:
    """Every indexed rollout's and prompt's words, as the keys their numbers stand for."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT 'rollout', t.rollout_id, s.word FROM rollout_search t, unnest(t.words) "
                "AS u(w) JOIN search_words s ON s.id = u.w UNION ALL SELECT 'prompt', "
                "t.prompt_id, s.word FROM prompt_search t, unnest(t.words) AS u(w) "
                "JOIN search_words s ON s.id = u.w"
            )
        ).all()
    out: dict[tuple[str, int], set[str]] = {}
    for kind, row_id, word in rows:
        out.setdefault((kind, row_id), set()).add(word)
    return out


@pytest.mark.postgres
def test_0013_adds_every_words_head_and_takes_it_back() -> None:
    """A database indexed before 0013 (its downgrade takes the heads out) gets from 0013 the
    very numbers the store writes today, and finds every query as a scan does."""
    with _fresh_pg("head") as pg:
        factory = make_session_factory(pg)
        steps = _steps(random.Random(7), range(1, 6))
        run_id = _write(factory, steps, index=True)
        written = _arrays(pg)
        assert any(k.startswith(search.HEAD_MARK) for keys in written.values() for k in keys)
        downgrade(pg, "0012")
        before = _arrays(pg)
        assert before.keys() == written.keys()
        assert before == {
            row: {k for k in keys if not k.startswith(search.HEAD_MARK)}
            for row, keys in written.items()
        }
        with pg.connect() as conn:
            assert not conn.execute(text("SELECT 1 FROM search_words WHERE word LIKE '*%'")).all()
        upgrade(pg)
        assert _arrays(pg) == written
        for q in QUERIES:
            assert _found(factory, run_id, q) == _expected(steps, q), q


def _search_columns(engine: Engine) -> dict[str, str]:
    """rollout_search's columns and their types, as information_schema names them."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = 'rollout_search'"
            )
        ).all()
    return {name: kind for name, kind in rows}


@pytest.mark.postgres
def test_0014_gives_each_indexed_rollout_its_run_and_takes_it_back() -> None:
    """A database indexed before 0014 (its downgrade takes the runs out) gets each row's run
    from 0014, and each of two runs of the same words then finds and counts its own."""
    with _fresh_pg("head") as pg:
        factory = make_session_factory(pg)
        steps = [_steps(random.Random(seed), range(1, 4)) for seed in (8, 9)]
        runs = [_write(factory, each, index=True) for each in steps]
        downgrade(pg, "0013")
        assert _search_columns(pg) == {"rollout_id": "integer", "words": "ARRAY"}
        upgrade(pg)
        with pg.connect() as conn:
            pairs = conn.execute(
                text(
                    "SELECT r.run_id, t.run_id FROM rollouts r "
                    "LEFT JOIN rollout_search t ON t.rollout_id = r.id"
                )
            ).all()
        assert len(pairs) == 2 * 3 * 6 and all(r == t for r, t in pairs)
        for run_id, each in zip(runs, steps, strict=True):
            for q in QUERIES:
                assert _found(factory, run_id, q) == _expected(each, q), q


@pytest.mark.postgres
def test_0010_carries_the_tsvector_index(pg_0009: Engine) -> None:
    factory = make_session_factory(pg_0009)
    steps = _steps(random.Random(5), range(1, 6))
    prompt = steps[0].rollouts[0].prompt
    with pg_0009.begin() as conn:  # the prompt as 0006's store wrote it (nothing to index)
        conn.execute(
            text("INSERT INTO prompts (sha256, text) VALUES (:h, :t)"),
            {"h": sha256_text(prompt), "t": prompt},
        )
    # Today's store writes the columns and tables later migrations add (0011's, 0017's, 0019's
    # prompt rollups, 0020's generator logprobs, 0021's mismatch columns): present while it
    # writes, then dropped, so that the database is 0009's again when it is upgraded.
    later = {
        "runs": ("record_key", "recorded_by", "record_epoch", "ended_by"),
        "alerts": ("notify_state", "notify_error"),
        "rollout_data": ("generator_logprobs",),
        "rollouts": ("abs_diff_max", "log_seq_ratio"),
    }
    typed = {
        "record_epoch": "integer NOT NULL DEFAULT 0",
        "generator_logprobs": "bytea",
        "abs_diff_max": "double precision",
        "log_seq_ratio": "double precision",
    }
    rollups = [PromptGroupRow.__table__, RunPromptRow.__table__]
    with pg_0009.begin() as conn:
        for table, columns in later.items():
            for column in columns:
                kind = typed.get(column, "text")
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))
        for rollup in rollups:
            rollup.create(conn)
    run_id = _write(factory, steps, index=False)  # indexed below as 0006's store did
    with pg_0009.begin() as conn:
        for table, columns in later.items():
            conn.execute(
                text(f"ALTER TABLE {table} " + ", ".join(f"DROP COLUMN {c}" for c in columns))
            )
        for rollup in reversed(rollups):
            rollup.drop(conn)
    pg_0009.dispose()  # no pooled connection keeps the columns' old row type
    with pg_0009.begin() as conn:
        rows = conn.execute(
            text("SELECT r.id, r.step, r.idx FROM rollouts r WHERE r.run_id = :r ORDER BY r.id"),
            {"r": run_id},
        ).all()
        texts = {(s.step, r.index): r.completion for s in steps for r in s.rollouts}
        for rid, step, idx in rows:
            conn.execute(
                text(
                    "INSERT INTO rollout_search (rollout_id, doc) "
                    "VALUES (:i, strip(to_tsvector('simple', :w)))"
                ),
                {"i": rid, "w": search.words(texts[(step, idx)])},
            )
    upgrade(pg_0009)
    for q in QUERIES:
        assert _found(factory, run_id, q) == _expected(steps, q), q
    # the prompt's words were numbered by the migration: a search finds every rollout by them
    everyone = {(s.step, r.index) for s in steps for r in s.rollouts}
    assert _found(factory, run_id, "prompt words") == everyone
    assert _search_columns(pg_0009) == {
        "rollout_id": "integer",
        "run_id": "integer",
        "words": "ARRAY",
    }
    # and the store goes on indexing the run's next steps
    more = _steps(random.Random(6), range(6, 8))
    with session_scope(factory) as session:
        store.write_steps(session.connection(), None, more, run_id=run_id, control_tokens=())
    for q in QUERIES:
        assert _found(factory, run_id, q) == _expected(steps + more, q), q


@pytest.fixture
def pg(pg_engine: Engine, _pg_reset: Callable[[], None]) -> Engine:
    """The session's PostgreSQL database, emptied."""
    _pg_reset()
    return pg_engine


_COSTLY = "EXPLAIN (ANALYZE, FORMAT JSON) SELECT sum(g) FROM generate_series(1, 1000) AS g"


def _compiled(conn: Connection) -> bool:
    """Whether PostgreSQL JIT-compiled a statement costed past every JIT threshold."""
    conn.execute(text("SET jit_above_cost = 0"))
    return "JIT" in conn.execute(text(_COSTLY)).scalar_one()[0]


@pytest.mark.postgres
def test_the_stores_connections_never_jit_compile(pg_engine: Engine) -> None:
    """make_engine's PostgreSQL connections, a new one after the pool lost the old included,
    run with jit off: a search's statement costed as a walk of a whole run was compiled for
    longer than it ran (server.store.db._postgres_settings)."""
    plain = create_engine(pg_engine.url)
    with plain.connect() as conn:
        can_compile = _compiled(conn.execution_options(isolation_level="AUTOCOMMIT"))
    plain.dispose()
    if not can_compile:
        pytest.skip("this PostgreSQL server cannot JIT-compile (no LLVM)")
    engine = make_engine(pg_engine.url.render_as_string(hide_password=False))
    for _ in range(2):
        with engine.connect() as conn:
            assert not _compiled(conn)
            conn.rollback()
        engine.dispose()  # the next connection is a new one
    engine.dispose()


def _plans(engine: Engine) -> tuple[int, int]:
    """The generic and custom plans of the statements that one of `engine`'s connections
    prepared for a statement run 12 times, each with another value."""
    with engine.connect() as conn:
        for i in range(12):
            conn.execute(text("SELECT id FROM runs WHERE id = :i"), {"i": i}).all()
        generic, custom = conn.execute(
            text(
                "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0) "
                "FROM pg_prepared_statements"
            )
        ).one()
        conn.rollback()
    return int(generic), int(custom)


@pytest.mark.postgres
def test_the_stores_connections_plan_each_statement_for_its_values(pg_engine: Engine) -> None:
    """psycopg prepares a statement that a connection has run 5 times, and PostgreSQL then
    plans it once for any values (by default): a search's constant arrays, which only a plan
    that sees them hashes, were then compared one by one (a page's 11th request: 19 ms → 1.3 s).
    make_engine's connections prepare, and plan each run for its own values."""
    plain = create_engine(pg_engine.url)
    assert _plans(plain)[0] > 0  # the default: one generic plan, reused
    plain.dispose()
    engine = make_engine(pg_engine.url.render_as_string(hide_password=False))
    generic, custom = _plans(engine)
    engine.dispose()
    assert generic == 0 and custom > 0


@pytest.mark.postgres
def test_each_step_leaves_no_gin_pending_list(pg: Engine) -> None:
    """GIN's pending list, which every search reads whole, is merged after each step's
    indexing (search.merge_pending): none is left for the searches between steps."""
    with pg.begin() as conn:
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))

    def pending(index: str) -> int:
        with pg.connect() as conn:
            found = conn.execute(
                text("SELECT pending_pages FROM pgstatginindex(:i)"), {"i": index}
            ).scalar_one()
        return int(found)

    factory = make_session_factory(pg)
    _write(factory, _steps(random.Random(4), range(1, 4)), index=False)
    assert pending(search.PROMPT_WORDS_INDEX) == 0  # the run's new prompt, merged as indexed
    with pg.begin() as conn:  # rows inserted as GIN takes them: queued in the list
        conn.execute(
            text(
                "INSERT INTO rollout_search (rollout_id, run_id, words) "
                "SELECT id, run_id, '{1,2}' FROM rollouts"
            )
        )
        conn.execute(text("DELETE FROM rollout_search"))
    assert pending(search.ROLLOUT_WORDS_INDEX) > 0
    steps = _steps(random.Random(5), range(1, 4))
    run_id = _write(factory, steps, index=True)
    assert pending(search.ROLLOUT_WORDS_INDEX) == 0
    assert _found(factory, run_id, "zeal") == _expected(steps, "zeal")


@pytest.mark.postgres
def test_a_role_that_does_not_own_the_index_indexes_without_merging(pg: Engine) -> None:
    role = f"rl_writer_{uuid.uuid4().hex[:8]}"
    with pg.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" NOLOGIN'))
        conn.execute(text(f'GRANT SELECT, INSERT ON rollout_search TO "{role}"'))
    try:
        with pg.begin() as conn:
            conn.execute(text(f'SET LOCAL ROLE "{role}"'))
            search.merge_pending(conn, search.ROLLOUT_WORDS_INDEX)  # no error: left as it is
            assert conn.execute(text("SELECT current_user")).scalar() == role
    finally:
        with pg.begin() as conn:
            conn.execute(text(f'REVOKE ALL ON rollout_search FROM "{role}"'))
            conn.execute(text(f'DROP ROLE "{role}"'))


@pytest.mark.parametrize("q", QUERIES)
def test_a_search_past_the_common_mark_finds_what_a_scan_finds(
    session_factory: sessionmaker[Session], q: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common path (PostgreSQL: past COMMON_FROM matches a whole word is tested row by row, a
    prefix's matches are looked up in one read of the index) finds what the rare path finds."""
    monkeypatch.setattr(search, "COMMON_FROM", 1)
    steps = _steps(random.Random(3), range(1, 5))
    run_id = _write(session_factory, steps, index=True)
    assert _found(session_factory, run_id, q) == _expected(steps, q)


def _plan(pg: Engine, statement: str, parameters: Any) -> dict[str, Any]:
    """PostgreSQL's plan of a statement that ran (sql_support.executed), as if its tables were
    big: a test's tiny table would be read whole by cost, whatever index could serve. Its
    tables analyzed first: the statistics the tests before left (or none) would have the
    planner weigh indexes by rows that are not there."""
    with pg.begin() as conn:
        conn.execute(text("ANALYZE rollouts"))
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        (plan,) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar()
    return dict(plan["Plan"])


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def _replayed_plan(pg: Engine, ran: list[tuple[str, Any]], index: int) -> dict[str, Any]:
    """PostgreSQL's plan of the `index`th statement that ran (sql_support.executed) as the store
    planned it: the statements before it are run again first, in one transaction, so that the
    settings they made hold (on a test's tiny tables, as on a small run's)."""
    with pg.begin() as conn:
        for statement, parameters in ran[:index]:
            conn.exec_driver_sql(statement, parameters)
        statement, parameters = ran[index]
        (plan,) = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar()
    return dict(plan["Plan"])


@pytest.mark.postgres
def test_a_prefix_is_one_bitmap_scan_of_the_words_index(pg: Engine) -> None:
    """A prefix's words are found by one bitmap index scan, each of its words' GIN scans ORed
    into one bitmap (`words @> ANY(terms)`, migration 0015's search_term), not a scan a word
    that reads a row once for each of its words that match (each row is read once), in the
    completions' index and the prompts'. Even on tiny tables, where PostgreSQL would read the
    table whole and each row's words once for each of the prefix's (a 1,000-word prefix over
    2,048 rollouts: 10.6 s)."""
    factory = make_session_factory(pg)
    steps = _steps(random.Random(3), range(1, 5))
    run_id = _write(factory, steps, index=True)
    with executed(pg) as ran:
        assert _found(factory, run_id, "ze*") == _expected(steps, "ze*")  # zeal, zebra, zeb
    for table, index in [
        ("rollout_search", search.ROLLOUT_WORDS_INDEX),
        ("prompt_search", search.PROMPT_WORDS_INDEX),
    ]:
        (at,) = [i for i, (s, _) in enumerate(ran) if f"FROM {table}" in s]
        plan = _replayed_plan(pg, ran, at)
        nodes = [node["Node Type"] for node in _plan_nodes(plan)]
        scans = [n for n in _plan_nodes(plan) if n["Node Type"] == "Bitmap Index Scan"]
        assert [n["Index Name"] for n in scans] == [index], (table, nodes)
        assert "ANY" in scans[0]["Index Cond"], scans[0]
        assert "Nested Loop" not in nodes and nodes.count("Bitmap Heap Scan") == 1, nodes


@pytest.mark.postgres
@pytest.mark.parametrize("before", ["on", "off"])
def test_a_prefix_search_leaves_the_planner_as_it_found_it(pg: Engine, before: str) -> None:
    """The prefix's statements are planned without sequential scans, and the transaction's
    later statements (the page's count and rows) with the setting it had before the search."""
    factory = make_session_factory(pg)
    steps = _steps(random.Random(3), range(1, 3))
    run_id = _write(factory, steps, index=True)
    with pg.begin() as conn, executed(pg) as ran:
        conn.execute(text(f"SET LOCAL enable_seqscan = {before}"))
        match = search.match_sql(conn, run_id=run_id, q="ze*")
        after = conn.execute(text("SELECT current_setting('enable_seqscan')")).scalar()
    assert after == before
    assert match.total == len(_expected(steps, "ze*")) > 0
    searched = [i for i, (s, _) in enumerate(ran) if "_search" in s]
    offs = [i for i, (s, _) in enumerate(ran) if "'enable_seqscan', 'off'" in s]
    assert len(offs) == len(searched) == 2
    assert [o + 1 for o in offs] == searched  # each search just after its setting


PROMPTS = ("Pick one: über shared", "Pick one: zeal shared", "Pick one: zeal straße")


@pytest.mark.parametrize("q", ["shared", "pick one", "zeal", "über", "zeal shared", "sha*"])
def test_words_in_prompts_find_every_rollout_of_those_prompts(
    session_factory: sessionmaker[Session], engine: Engine, q: str
) -> None:
    """A rollout matches by its prompt or by its completion. On PostgreSQL, where the prompts
    that match are all the run's (`shared`, in two of another run's three), its completions'
    index is not read; where they are some (`zeal` in the second run), the others' completions
    are searched (SQLite always searches them)."""
    first = _steps(random.Random(3), range(1, 4), PROMPTS[:2])
    second = _steps(random.Random(4), range(1, 4), PROMPTS)
    runs = [_write(session_factory, each, index=True) for each in (first, second)]
    postgres = engine.dialect.name == "postgresql"
    for run_id, each in zip(runs, (first, second), strict=True):
        with executed(engine) as ran:
            assert _found(session_factory, run_id, q) == _expected(each, q)
        every = {r.prompt for record in each for r in record.rollouts}
        read = any("rollout_search" in s or "rollout_fts_" in s for s, _ in ran)
        covered = all(_has_all(p, q) for p in every) and postgres
        assert read == (not covered), (run_id, ran)
        if postgres:  # the run's prompts are read from their index, a look-up each
            (walk,) = [(s, p) for s, p in ran if "WITH RECURSIVE" in s]
            used = {n.get("Index Name") for n in _plan_nodes(_plan(engine, *walk))}
            assert search.RUN_PROMPTS_INDEX in used, used


def _run(factory: sessionmaker[Session]) -> int:
    with session_scope(factory) as session:
        return store.create_run(session, name="words", model="m", total_steps=4, group_size=6).id


def _word_keys_asked(ran: list[tuple[str, Any]]) -> set[str]:
    """The keys a writer's statements asked search_words to number."""
    asked: set[str] = set()
    for statement, parameters in ran:
        if statement.startswith("INSERT INTO search_words"):
            asked.update(parameters[0].strip("{}").strip('"').split('","'))
    return asked


@pytest.mark.postgres
def test_a_writer_asks_only_for_the_word_numbers_it_has_not_used(pg: Engine) -> None:
    """A run's writer (write_batch's Recorder) numbers each word once, its completions' and its
    prompts': a later step asks search_words only for keys its earlier steps did not have (a
    new prompt's known words included), and searches find every step."""
    factory = make_session_factory(pg)
    run_id = _run(factory)
    steps = _steps(random.Random(6), range(1, 4))
    steps[2].rollouts[0].completion += " quokka"  # a word of step 3 alone
    for rollout in steps[2].rollouts:  # a new prompt in step 3: known words and one new
        rollout.prompt = "Pick one: prompt words only, narwhal"
    recorder = None
    asked = []
    for step in steps:
        with executed(pg) as ran:
            recorder = store.write_batch(
                pg, recorder, [step], run_id=run_id, control_tokens=(), price_per_hour=0.0
            )
        asked.append(_word_keys_asked(ran))
    assert "zeal" in asked[0] and {"quokka", "*quo", "narwhal", "*nar"} <= asked[2]
    assert not asked[1] & asked[0] and not asked[2] & (asked[0] | asked[1])  # each key once
    for q in ("zeal", "quokka", "über*", "zeb*", "narwhal", "prompt words"):
        assert _found(factory, run_id, q) == _expected(steps, q)


@pytest.mark.postgres
@pytest.mark.parametrize("fails_at", ["merge", "commit"])
def test_word_numbers_of_a_failed_indexing_are_not_kept(
    pg: Engine, monkeypatch: pytest.MonkeyPatch, fails_at: str
) -> None:
    """An indexing transaction that numbers new words and then fails (a step's search put
    off, its recorder kept) leaves no number behind in the writer: the step's rollouts wait,
    are indexed with the next step, and its new words are found."""
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    factory = make_session_factory(pg)
    run_id = _run(factory)
    steps = _steps(random.Random(7), range(1, 4))
    steps[1].rollouts[0].completion += " wombat"  # new in step 2, whose indexing fails
    recorder = store.write_batch(
        pg, None, steps[:1], run_id=run_id, control_tokens=(), price_per_hour=0.0
    )
    calls: list[str] = []

    def fail(*_: Any) -> None:  # the indexing's merge, or its commit (the second of the batch)
        calls.append(fails_at)
        if len(calls) == (1 if fails_at == "merge" else 2):
            raise OperationalError("the link went away", {}, Exception("reset"))

    if fails_at == "merge":
        monkeypatch.setattr(search, "merge_pending", fail)
    else:
        event.listen(pg, "commit", fail)
    try:
        recorder = store.write_batch(
            pg, recorder, steps[1:2], run_id=run_id, control_tokens=(), price_per_hour=0.0
        )
    finally:
        monkeypatch.undo()
        if fails_at == "commit":
            event.remove(pg, "commit", fail)
    assert len(calls) == (1 if fails_at == "merge" else 2)
    assert recorder.unindexed and _found(factory, run_id, "wombat") == set()  # written, waiting
    recorder = store.write_batch(
        pg, recorder, steps[2:], run_id=run_id, control_tokens=(), price_per_hour=0.0
    )
    for q in ("wombat", "zeal", "über*"):
        assert _found(factory, run_id, q) == _expected(steps, q)
