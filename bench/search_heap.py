"""PostgreSQL: what a narrow `rollout_search` heap would buy the prefix search (an experiment).

A rollout's word numbers of this bench's size (~180 int4, ~740 B) sit inline in
rollout_search's heap: a row under 2 KB is never toasted, whatever `toast_tuple_target` says
(heap_insert only calls the toaster past the compiled TOAST_TUPLE_THRESHOLD). So the heap is
~400 MB at 512,000 rollouts and every GIN match costs a read of it from the OS cache. This bench
builds the same synthetic word numbers (log-uniform draws, ~180 distinct a row, as the full-shape
bench's were before migration 0013 added their heads) two ways, each under a GIN index, and times
a prefix's SQL (one GIN scan a word, the lateral join search._by_prefix was before migration
0015 made it one bitmap scan) and a whole word's scan on both:

- inline: a small row's layout (words STORAGE EXTERNAL, inline because the row is small);
- narrow: words STORAGE EXTERNAL, toast_tuple_target=128, and a `pad` text of 2,100 dots written
  with each row, which makes the row cross the threshold; the toaster compresses the pad to
  ~35 B and moves the words out of line, leaving a ~90 B heap row (an 18 B pointer).

It prints the bytes a row of heap, TOAST and GIN, and p50 ms of each query, with the narrow/inline
ratio. Not built into the store: docs/benchmarks/search.md says why (this prefix stayed over
200 ms either way; a 3-character prefix is now one number, its head's, and a full-shape row's
words with their heads are past 2 KB, so they are toasted without a pad).

    python -m bench.search_heap [--pg URL] [--rows 512000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from sqlalchemy import Connection, create_engine, text

from bench.pages import PG_DEFAULT, pg_database

VOCAB = 600_000  # word numbers drawn from 1..VOCAB, log-uniform (a Zipf-like spread)
DRAWS = 220  # draws a row; ~180 distinct survive, as in the full-shape bench's completions

LAYOUTS = {
    "inline": ("", "NULL"),
    "narrow": ("ALTER TABLE {t} SET (toast_tuple_target = 128)", "repeat('.', 2100)"),
}


def build(conn: Connection, name: str, rows: int) -> None:
    """Table `name` of `rows` rows of word numbers in layout `name`, its GIN index, ANALYZEd."""
    setting, pad = LAYOUTS[name]
    conn.execute(
        text(
            f"CREATE TABLE {name} (rollout_id integer PRIMARY KEY, words integer[] NOT NULL, "
            "pad text)"
        )
    )
    conn.execute(text(f"ALTER TABLE {name} ALTER COLUMN words SET STORAGE EXTERNAL"))
    if setting:
        conn.execute(text(setting.format(t=name)))
    conn.execute(text("SELECT setseed(0.29)"))
    # `g % 2` ties the draws to the row: uncorrelated, the sub-select would run once and every
    # row would hold the same words
    conn.execute(
        text(
            f"INSERT INTO {name} SELECT g, ARRAY(SELECT DISTINCT "
            f"(exp(random() * ln({VOCAB})))::integer FROM generate_series(1, {DRAWS} + g % 2) "
            f"ORDER BY 1), {pad} FROM generate_series(1, :rows) AS g"
        ),
        {"rows": rows},
    )
    conn.execute(text("SET maintenance_work_mem = '512MB'"))
    conn.execute(text(f"CREATE INDEX {name}_words ON {name} USING gin (words)"))
    conn.execute(text(f"ANALYZE {name}"))


def sizes(conn: Connection, name: str, rows: int) -> str:
    heap, toast, gin = conn.execute(
        text(
            "SELECT pg_relation_size(c.oid), coalesce(pg_total_relation_size(c.reltoastrelid), 0),"
            " pg_relation_size(to_regclass(:gin)) FROM pg_class c WHERE c.relname = :t"
        ),
        {"t": name, "gin": f"{name}_words"},
    ).one()
    return (
        f"heap {heap / rows:,.0f} B a row ({heap / 2**20:,.0f} MB), TOAST {toast / rows:,.0f} B,"
        f" GIN {gin / rows:,.0f} B"
    )


def queries() -> dict[str, tuple[str, dict[str, object]]]:
    """Query name → SQL on table {t}, parameters. The prefix's numbers are rare ones (a few
    matches each, as `ves*`'s 11,575 words at 1,000 full steps), a fiftieth of the vocabulary."""
    lo = VOCAB - VOCAB * 77 // 1000
    prefix = list(range(lo, VOCAB + 1, 4))
    return {
        f"prefix ({len(prefix):,} words)": (
            "SELECT count(*), length(array_agg(k ORDER BY k)::text) FROM (SELECT DISTINCT "
            "m.rollout_id FROM unnest((SELECT CAST(:n AS integer[]))) AS n(w) CROSS JOIN LATERAL "
            "(SELECT p.rollout_id FROM {t} p WHERE p.words @> ARRAY[n.w]) AS m) AS x(k)",
            {"n": prefix},
        ),
        "rare word": (
            "SELECT count(*) FROM {t} WHERE words @> (SELECT ARRAY[CAST(:w AS integer)])",
            {"w": VOCAB - 1},
        ),
        "common word (first 20,001)": (
            "SELECT count(*) FROM (SELECT rollout_id FROM {t} WHERE words @> (SELECT ARRAY[CAST(:w AS integer)]) "
            "LIMIT 20001) AS m",
            {"w": 2},
        ),
    }


def p50(conn: Connection, sql: str, params: dict[str, object], repeat: int) -> tuple[float, float]:
    """(first, p50 of the rest) ms."""
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        conn.execute(text(sql), params).all()
        times.append((time.perf_counter() - start) * 1000)
    return times[0], statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pg", default=PG_DEFAULT, help=f"a PostgreSQL server ({PG_DEFAULT})")
    parser.add_argument("--rows", type=int, default=512_000, help="rollouts (512,000)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of a query (5)")
    args = parser.parse_args(argv)
    with pg_database(args.pg) as url:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text("SET jit = off"))
            times: dict[str, dict[str, float]] = {}
            for name in LAYOUTS:
                start = time.perf_counter()
                build(conn, name, args.rows)
                built = time.perf_counter() - start
                print(f"\n== {name}: {args.rows:,} rows built in {built:,.1f} s")
                print(f"  {sizes(conn, name, args.rows)}")
                times[name] = {}
                for label, (sql, params) in queries().items():
                    first, mid = p50(conn, sql.format(t=name), params, args.repeat)
                    times[name][label] = mid
                    print(f"  {label}: p50 {mid:,.1f} ms (first {first:,.1f})")
        engine.dispose()
    print("\n== ratio narrow/inline (p50)")
    for label, mid in times["inline"].items():
        print(f"  {label}: {times['narrow'][label] / mid:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
