"""Scale bench: a user's GRPO shape written through the real write path, its bytes on disk
against TRL's own completions parquet, and the pages that read it at 100 and 1,000 steps.

Data (bench/scale_data.py): steps of 64 groups × 8 rollouts × ~1,024 tokens (varying per
rollout), 4 control tokens, a 150k vocabulary; token ids Zipf-like, token texts that concatenate
to the completion, logprobs mostly near 0, control-token probabilities mostly near 0 with the
close tag near 1 at the call's end, a dataset of 5,000 tool-listing prompts (a few KB each)
read in epochs (a seeded shuffle each), group-normalised advantages, a few verifier/truth
disagreements, a stretch of broken calls every 50 steps. Seeded: every run writes the same steps.

1. Write. Each step is built (untimed), then written by `store.write_batch` (the StepWriter's
   one transaction with a kept Recorder) into a migrated SQLite file and, with --pg, a database
   created on that PostgreSQL server (dropped at the end): ms a step (median, p90, max) and
   M completion tokens/s; TRL's parquet of the same step is written and timed beside it.
2. Disk, after --steps full-shape steps: the SQLite file after VACUUM (by table and index from
   dbstat), PostgreSQL's pg_total_relation_size of every table (heap + TOAST + indexes), and the
   TRL-style parquet (one file a step: step, prompt, completion, the reward, advantage; pandas
   `to_parquet` defaults, as GRPOTrainer.log writes them): bytes a rollout and a token, ratio;
   then a rollout's bytes by column (text, binary and JSON columns, read from the schema).
3. Pages, at --steps and again after a fill to --fill-to steps (rollouts of ~--fill-tokens
   tokens: at 1,000 steps that is 512,000 rollouts): p50/p90 of the app's own Server-Timing
   through FastAPI's TestClient, and bytes, for the step viewer, a group's page, their JSON, the
   run page and its series, and the rollout explorer, one query per filter kind plus a second
   keyset page; at step --steps/2, its middle group. A page gets --repeat requests after a
   warm-up, fewer (at least 2) once --budget seconds are spent on it, so a page that takes
   seconds shows n = 2 or 3. PostgreSQL is ANALYZEd first (as autovacuum would have). A route
   that answers 404 (not built yet) prints `n/a (404)`; any other non-200 is an error (the bench
   goes on and exits 1). Targets are printed beside each figure. With --cold COMMAND (root:
   restart PostgreSQL, drop the operating system's file cache) each page is asked once more
   after its warm requests, after that command and on new database connections (a search
   COLD_READS times, each after the command, its figure their median): `cold ms` is the page
   read from disk (the app's own templates and modules still loaded), p50 warm.
   The prompt lens (issue 46) beside them: the prompts list by look, sort and search, its
   heatmap's data, the history of the prompt with the most groups and the export; the run
   reads its 5,000 prompts in epochs, so at 1,000 steps each prompt has some 13 groups.

    .venv/bin/python -m bench.scale [--pg [URL]] [--quick] [--groups 64] [--group-size 8] [--prompts 5000]
        [--tokens 1024] [--vocab 150000] [--ctrl 4] [--steps 100] [--fill-to 1000]
        [--fill-tokens 64] [--repeat 20] [--budget 4] [--cache DIR]
    .venv/bin/python -m bench.scale --write-only [--pg] [--steps 20]   # write figures, GIL
    .venv/bin/python -m bench.scale --profile [WARM] [--pg]   # cProfile of step WARM+1's write
    .venv/bin/python -m bench.scale --text real --steps 10 --fill-to 10 [--pg]   # real text
    .venv/bin/python -m bench.scale --pg --cache DIR --keep   # leaves both databases there
    .venv/bin/python -m bench.scale --reuse DIR/scale-*/scale.db [--pg KEPT_URL]   # pages again
        [--cold 'pg_ctlcluster 15 main restart && sync && echo 3 > /proc/sys/vm/drop_caches']

The full run with --pg takes 9 to 12 minutes on two busy cores (the 100 full steps 4 to 5,
the fill about 5, the pages the rest; building steps is a third of it) and about 4 GB of disk
under --cache (a temporary folder by default, removed at the end).
`--quick` (well under a minute: a few small steps, 2 requests a page) keeps it working in CI.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit

import numpy as np
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store.db import (
    WEB_POOL,
    make_engine,
    make_session_factory,
    session_scope,
)
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunSource, RunStatus
from rollout_lens.server.webapp.app import create_app
from sqlalchemy import JSON, Engine, LargeBinary, String, create_engine, inspect, text
from sqlalchemy.engine import make_url

from bench import scale_real
from bench.pages import PG_DEFAULT, chart_names, pg_database
from bench.scale_data import ScaleRun, Shape, trl_table

QUICK = {"groups": 4, "tokens": 96, "steps": 4, "fill_to": 10, "fill_tokens": 16, "repeat": 2}
WRITE_TARGET_MS = 300
# a step's commit ÷ TRL's parquet write of it, and its search indexing's (issue 49)
RATIO_TARGETS = {"SQLite": 5.0, "PostgreSQL": 8.0}
INDEX_TARGET = 5.0
TOKENS_TARGET = 1.7  # M tokens/s
STEP_PAGE_KB, JSON_MB = 300, 2


@dataclass
class Database:
    """One database the bench writes: its engine, run and the write times of its steps."""

    label: str
    url: str
    engine: Engine
    run_id: int
    control_tokens: tuple[str, ...]
    recorder: store.Recorder | None = None
    seconds: list[float] = field(default_factory=list)
    fill_seconds: list[float] = field(default_factory=list)

    index_seconds: list[float] = field(default_factory=list)

    def write(self, record: StepRecord) -> float:
        """Write one step as the StepWriter does (its commit, then its search indexing in a
        transaction of its own); seconds in all, the indexing's kept in index_seconds."""
        start = time.perf_counter()
        self.recorder = store.write_batch(
            self.engine,
            self.recorder,
            [record],
            run_id=self.run_id,
            control_tokens=self.control_tokens,
            price_per_hour=2.0,
        )
        self.index_seconds.append(self.recorder.index_seconds)
        return time.perf_counter() - start


def open_database(label: str, url: str, run: ScaleRun, total_steps: int) -> Database:
    """Migrate the database at `url` and create the bench's run in it."""
    engine = make_engine(url)
    upgrade(engine)
    shape = run.shape
    with session_scope(make_session_factory(engine)) as session:
        run_id = store.create_run(
            session,
            name=f"scale {shape.groups}x{shape.group_size}x{shape.tokens}",
            model="Qwen/Qwen3-8B",
            total_steps=total_steps,
            group_size=shape.group_size,
            prompts_per_step=shape.groups,
            config={"groups": shape.groups, "tokens": shape.tokens, "vocab": shape.vocab},
            control_tokens=run.control_tokens,
            status=RunStatus.running,
            source=RunSource.callback,
        ).id
    return Database(label, url, engine, run_id, run.control_tokens)


# --- figures -----------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


# --- 1. write ----------------------------------------------------------------------------------


@dataclass
class Written:
    """What the full-shape steps came to: counts, and the parquet files beside them."""

    rollouts: int = 0
    tokens: int = 0
    build_seconds: list[float] = field(default_factory=list)
    parquet_seconds: list[float] = field(default_factory=list)
    parquet_bytes: int = 0
    floor: scale_real.Floor = field(default_factory=scale_real.Floor)


def write_steps(
    run: ScaleRun, dbs: list[Database], steps: range, parquet: Path | None, tokens: int | None
) -> Written:
    """Build each step (untimed), write it to every database (timed), and its TRL parquet."""
    import pandas as pd

    written = Written()
    for step in steps:
        start = time.perf_counter()
        record = run.step(step, tokens=tokens)
        written.build_seconds.append(time.perf_counter() - start)
        written.rollouts += len(record.rollouts)
        written.tokens += sum(len(r.completion_ids) for r in record.rollouts)
        if parquet is not None:
            written.floor.add(record)
        for db in dbs:
            (db.seconds if parquet else db.fill_seconds).append(db.write(record))
        if parquet is not None:
            path = parquet / f"completions_{step:05d}.parquet"
            start = time.perf_counter()
            pd.DataFrame(trl_table(record)).to_parquet(path)
            written.parquet_seconds.append(time.perf_counter() - start)
            written.parquet_bytes += path.stat().st_size
        _progress(f"step {step}/{steps.stop - 1}")
    _progress("")
    return written


def _progress(note: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r  {note:<40}\r" if note else "\r" + " " * 44 + "\r")
        sys.stderr.flush()


def print_write(dbs: list[Database], written: Written, steps: int, fill: bool = False) -> None:
    per_step, per_rollout = written.tokens / steps, written.tokens / written.rollouts
    print(
        f"  {steps} steps of {written.rollouts // steps:,} rollouts × ~{per_rollout:,.0f} tokens"
        f" ({per_step:,.0f} tokens a step); building a step took"
        f" {statistics.median(written.build_seconds):.2f} s (untimed)"
    )
    parquet = statistics.median(written.parquet_seconds) if written.parquet_seconds else None
    print(
        f"  {'':<12} {'median':>9} {'p90':>9} {'max':>9} {'M tokens/s':>11} {'× parquet':>10}"
        "   target"
    )
    for db in dbs:
        times = db.fill_seconds if fill else db.seconds
        ms = [t * 1000 for t in times]
        rate = written.tokens / sum(times) / 1e6
        median = statistics.median(ms)
        ratio = f"{median / 1000 / parquet:10.1f}" if parquet else f"{'':>10}"
        print(f"  {db.label:<12} {_spread(ms)} {rate:11.2f} {ratio}   (committed and indexed)")
        if fill:
            continue
        index = db.index_seconds[-len(times) :]
        committed = [(t - i) * 1000 for t, i in zip(times, index, strict=True)]
        indexed = [i * 1000 for i in index]
        for part, ms_, bound, note in (
            ("committed", committed, RATIO_TARGETS[db.label], f"(≤ {WRITE_TARGET_MS} ms quiet)"),
            ("indexed", indexed, INDEX_TARGET, "(search, after the commit)"),
        ):
            done = statistics.median(ms_) / 1000 / parquet if parquet else None
            shown = f"{done:10.1f}" if done is not None else f"{'':>10}"
            ok = _mark(done <= bound) if done is not None else ""
            target = f"≤ {bound:.0f}× parquet {note} {ok}"
            print(f"  {'  ' + part:<12} {_spread(ms_)} {'':>11} {shown}   {target}")
    if written.parquet_seconds:
        print(f"  {'TRL parquet':<12} {_spread([t * 1000 for t in written.parquet_seconds])}")


def _spread(ms: list[float]) -> str:
    return f"{statistics.median(ms):7.0f}ms {_pct(ms, 0.9):7.0f}ms {max(ms):7.0f}ms"


# --- 1b. the training thread beside a busy writer -----------------------------------------------

TRAIN_STEPS = 15  # training steps timed at least, alone and beside each writer
WRITER_STEPS = 3  # ... and beside the busy writer, until it has written at least this many
TRAIN_SECONDS = 120.0  # but no longer than this


def _training_step(work: np.ndarray) -> float:
    """A stand-in for a training step's host side: Python bookkeeping (holds the GIL) and a
    matrix product (releases it); seconds."""
    start = time.perf_counter()
    total = 0
    for i in range(60_000):  # TRL's per-step Python: logging, gathering, the callback
        total += i & 7
    work @ work
    return time.perf_counter() - start


def print_training_thread(run: ScaleRun, dbs: list[Database], first_step: int) -> None:
    """The training thread's step time alone and while a writer thread writes full-shape steps
    without pause (the StepWriter's thread at its busiest): what the writer's GIL costs it.
    Beside it, the same steps next to a thread as busy that never holds the GIL (zstd
    compressing, which releases it): what sharing the machine's cores alone costs, so that
    the writer's own GIL is the difference."""
    work = np.random.default_rng(0).random((384, 384))
    record = run.step(first_step)
    print(
        "\n== the training thread: a step's host work (Python + numpy), alone and beside a busy writer"
    )
    print(f"  {'':<22} {'median':>9} {'p90':>9} {'max':>9}   × alone   writer steps")
    alone = [_training_step(work) * 1000 for _ in range(TRAIN_STEPS)]
    print(f"  {'alone':<22} {_spread(alone)}")

    def steps(done: Callable[[], bool]) -> list[float]:
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < TRAIN_STEPS or (
            not done() and time.perf_counter() - start < TRAIN_SECONDS
        ):
            times.append(_training_step(work) * 1000)
        return times

    gil_free = _beside_gil_free(lambda: steps(lambda: True))
    ratio = statistics.median(gil_free) / statistics.median(alone)
    print(f"  {'beside a GIL-free one':<22} {_spread(gil_free)} {ratio:8.2f}×        –")
    busy = BusyWriter(record, first_step)
    for db in dbs:
        beside = busy.around(db, lambda: steps(lambda: busy.wrote >= WRITER_STEPS))
        ratio = statistics.median(beside) / statistics.median(alone)
        label = f"beside {db.label}"
        print(f"  {label:<22} {_spread(beside)} {ratio:8.2f}×   {busy.wrote:>6}")


def _beside_gil_free(work: Callable[[], list[float]]) -> list[float]:
    """`work` while a thread compresses without pause (zstd releases the GIL while it works)."""
    import zstandard

    stop = threading.Event()
    data = np.random.default_rng(1).integers(0, 64, 8 << 20, dtype=np.uint8).tobytes()

    def burn() -> None:
        compressor = zstandard.ZstdCompressor(level=3)
        while not stop.is_set():
            compressor.compress(data)

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    time.sleep(0.2)
    try:
        return work()
    finally:
        stop.set()
        thread.join()


class BusyWriter:
    """A thread writing full-shape steps one after another, as long as `around`'s work runs."""

    def __init__(self, record: StepRecord, step: int) -> None:
        self.record, self.step, self.wrote = record, step, 0
        self.stop = threading.Event()

    def _write(self, db: Database) -> None:
        while not self.stop.is_set():
            self.step += 1
            self.record.step = self.record.rollout_step = self.step
            db.write(self.record)
            self.wrote += 1

    def around(self, db: Database, work: Callable[[], list[float]]) -> list[float]:
        self.stop.clear()
        self.wrote = 0
        writer = threading.Thread(target=self._write, args=(db,), daemon=True)
        writer.start()
        time.sleep(0.2)  # the writer is inside a step
        try:
            return work()
        finally:
            self.stop.set()
            writer.join()


# --- 2. disk -----------------------------------------------------------------------------------


def sqlite_bytes(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The file's bytes after VACUUM, and table → (its pages, its indexes' pages) from dbstat."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
        owners = dict(conn.execute("SELECT name, tbl_name FROM sqlite_master"))
        parts: dict[str, tuple[int, int]] = {}
        try:
            pages = conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
        except sqlite3.OperationalError:  # an SQLite built without dbstat
            pages = []
        for name, size in pages:
            table = owners.get(name, name)
            own, indexes = parts.get(table, (0, 0))
            parts[table] = (own + size, indexes) if name == table else (own, indexes + size)
    finally:
        conn.close()
    return path.stat().st_size, parts


def postgres_bytes(engine: Engine) -> tuple[int, dict[str, tuple[int, int, int]]]:
    """pg_total_relation_size of every table, and table → (heap, TOAST, indexes)."""
    sql = text(
        "SELECT c.relname, pg_table_size(c.oid) - COALESCE(pg_total_relation_size("
        "NULLIF(c.reltoastrelid, 0)), 0), COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid,"
        " 0)), 0), pg_indexes_size(c.oid), pg_total_relation_size(c.oid) FROM pg_class c JOIN"
        " pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
    )
    with engine.connect() as conn:
        rows = conn.execute(sql).all()
    return sum(r[4] for r in rows), {r[0]: (r[1], r[2], r[3]) for r in rows}


def print_disk(
    dbs: list[Database],
    written: Written,
    sqlite_file: Path,
    targets: dict[str, float] | None = None,
) -> None:
    """Each database's bytes a rollout against the parquet's: marked against `targets` (label →
    most times the parquet's), else against the parquet's own."""
    n, tokens = written.rollouts, written.tokens
    trl = written.parquet_bytes / n
    print(
        f"  {n:,} rollouts, {tokens / 1e6:,.1f} M completion tokens; target: the database's "
        "bytes a rollout below the parquet's"
        + (" times " + ", ".join(f"{k} {v}" for k, v in targets.items()) if targets else "")
    )
    print(f"  {'':<34} {'total':>10} {'a rollout':>11} {'a token':>9} {'× parquet':>10}")

    def line(label: str, total: int, mark: str = "") -> None:
        print(
            f"  {label:<34} {_size(total):>10} {_size(total / n):>11} {total / tokens:7.1f} B"
            f" {total / n / trl:10.2f} {mark}"
        )

    def bound(db: Database) -> float:
        return (targets or {}).get(db.label, 1.0)

    line("TRL completions parquet", written.parquet_bytes)
    for db in dbs:
        if db.url.startswith("sqlite"):
            db.engine.dispose()  # VACUUM needs the file to itself
            total, parts = sqlite_bytes(sqlite_file)
            line("SQLite, after VACUUM", total, _mark(total / n <= bound(db) * trl))
            _sqlite_parts(parts, total)
        else:
            total, pg_parts = postgres_bytes(db.engine)
            line("PostgreSQL, tables+TOAST+indexes", total, _mark(total / n <= bound(db) * trl))
            _postgres_parts(pg_parts, total)
        _column_parts(db.engine, n)
        _column_parts(db.engine, n, "rollout_data")


def column_bytes(engine: Engine, table: str = "rollouts") -> dict[str, int]:
    """Bytes of each text, binary and JSON column of `table` as the database holds them
    (PostgreSQL: pg_column_size, after its compression; SQLite: the value's bytes). The columns
    are read from the schema, so a new storage format is measured as it is."""
    kinds = (String, LargeBinary, JSON)
    wide = [c["name"] for c in inspect(engine).get_columns(table) if isinstance(c["type"], kinds)]
    if engine.dialect.name == "postgresql":
        size = 'COALESCE(SUM(pg_column_size("{}")), 0)'
    else:
        size = 'COALESCE(SUM(length(CAST("{}" AS BLOB))), 0)'
    sql = f"SELECT {', '.join(size.format(c) for c in wide)} FROM {table}"
    with engine.connect() as conn:
        sums = conn.execute(text(sql)).one() if wide else ()
    return dict(zip(wide, (int(x) for x in sums), strict=True))


def _column_parts(engine: Engine, n: int, table: str = "rollouts") -> None:
    """Where a rollout's bytes go, by column of `table` (the columns over 1 % of them)."""
    parts = column_bytes(engine, table)
    total = sum(parts.values()) or 1
    shown = [
        f"{name} {_size(size / n)} ({100 * size / total:.0f} %)"
        for name, size in sorted(parts.items(), key=lambda kv: -kv[1])
        if size >= total / 100
    ]
    where = "" if table == "rollouts" else f" of {table}"
    print(f"    a rollout's text, binary and JSON columns{where}: {', '.join(shown)}")


def _sqlite_parts(parts: dict[str, tuple[int, int]], total: int) -> None:
    """Tables holding at least 0.1 % of the file, largest first."""
    for table, (own, indexes) in sorted(parts.items(), key=lambda kv: -sum(kv[1])):
        if own + indexes >= total / 1000:
            share = 100 * (own + indexes) / total
            sizes = f"table {_size(own):>10}  indexes {_size(indexes):>10}"
            print(f"    {table:<20} {sizes}  {share:5.1f} %")


def _postgres_parts(parts: dict[str, tuple[int, int, int]], total: int) -> None:
    """Tables holding at least 0.1 % of the total, largest first."""
    for table, (heap, toast, indexes) in sorted(parts.items(), key=lambda kv: -sum(kv[1])):
        if heap + toast + indexes >= total / 1000:
            share = 100 * (heap + toast + indexes) / total
            print(
                f"    {table:<20} heap {_size(heap):>10}  TOAST {_size(toast):>10}"
                f"  indexes {_size(indexes):>10}  {share:5.1f} %"
            )


def database_size(db: Database, sqlite_file: Path) -> int:
    """Bytes of a database as it stands (SQLite: file and WAL; PostgreSQL: every table)."""
    if db.url.startswith("sqlite"):
        wal = Path(f"{sqlite_file}-wal")
        return sqlite_file.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    return postgres_bytes(db.engine)[0]


# --- 3. pages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    label: str
    url: str
    ms_target: float | None = None  # p50
    kb_target: float | None = None


@dataclass
class Answer:
    status: int
    ms: float  # the app's own time (Server-Timing)
    body: bytes


def _get(client: TestClient, url: str) -> Answer:
    response = client.get(url)
    timing = response.headers.get("server-timing", "dur=0")
    return Answer(response.status_code, float(timing.split("dur=")[1]), response.content)


def measure(
    client: TestClient, url: str, repeat: int, budget: float
) -> tuple[list[float], Answer, float]:
    """Server times of `url` (ms) after a warm-up: `repeat` requests, or fewer (at least 2) once
    `budget` seconds are spent, so a page taking seconds does not hold the bench for minutes;
    and the first request's time (the page's first read of the run: its caches cold, as far as
    the databases' own buffers go — the operating system's file cache is not emptied)."""
    first = _get(client, url)
    if first.status != 200:
        return [], first, first.ms
    times = [first.ms] if first.ms > 1000 else []  # seconds of work: no warm-up cost to hide
    last, started = first, time.perf_counter()
    while len(times) < repeat and not (len(times) >= 2 and time.perf_counter() - started > budget):
        last = _get(client, url)
        if last.status != 200:
            return [], last, first.ms
        times.append(last.ms)
    return times, last, first.ms


def explorer_queries(
    run_id: int, steps: int, shape: Shape, words: tuple[str, str], vote: str
) -> list[Page]:
    """One explorer query a filter kind (the rollout explorer of issue 17, item 4)."""
    a = max(1, steps // 2)
    b = min(steps, a + max(1, steps // 10))
    filters = {
        "steps=A:B": {"steps": f"{a}:{b}"},
        "group=": {"group": shape.groups // 2},
        "state=": {"state": "collapse"},
        "format_valid=": {"format_valid": 0},
        "vote=": {"vote": vote},
        "target=": {"target": vote},
        "reward_min=&reward_max=": {"reward_min": 0.5, "reward_max": 1},
        "true_min=": {"true_min": 1},
        "adv_min=": {"adv_min": 2},
        "adv_max=": {"adv_max": -2},
        "disagree=1": {"disagree": 1},
        "len_min=": {"len_min": int(shape.tokens * 1.5)},
        "len_max=": {"len_max": max(8, shape.tokens // 4)},
        "alert=1": {"alert": 1},
        f"q= rare ({words[0]})": {"q": words[0]},
        f"q= common ({words[1]})": {"q": words[1]},
        f"q= two words ({words[1]} {words[0]})": {"q": f"{words[1]} {words[0]}"},
        f"q= prefix ({words[0][:3]}*)": {"q": f"{words[0][:3]}*"},  # a head: one number
        f"q= prefix ({words[0][:4]}*)": {"q": f"{words[0][:4]}*"},  # its words, one scan each
        # a common word's: its words' scans return most of the run
        f"q= prefix ({words[1][:4]}*)": {"q": f"{words[1][:4]}*"},
        "sort=advantage&order=desc": {"sort": "advantage", "order": "desc"},
    }
    return [
        Page(
            f"explorer {label}",
            f"/api/runs/{run_id}/rollouts?{urlencode(query)}",
            200,
            JSON_MB * 1000,
        )
        for label, query in filters.items()
    ]


PROMPTS_MS, HISTORY_MS, HEATMAP_MS = 200, 100, 300  # the prompt lens's targets (issue 46)
COLD_TIMES = 2  # --cold: a search's first answer after a restart, at most this × its warm p50
# --cold: a search's figure is the median of its first answers after this many restarts (one
# restart a search gave 1.94× one day and 2.5× the next for the same prefix: a single cold
# request against a median of warm ones); other pages take one.
COLD_READS = 3


def prompt_lens_pages(db: Database, run: ScaleRun) -> list[Page]:
    """The prompt lens (issue 46): the prompts list by each look, a sort, a search and its second
    keyset page; the heatmap's data (a page of rows, and the widest page); the history of the
    prompt with the most groups, with and without completions; the export; the HTML pages."""
    with db.engine.connect() as conn:
        busiest = conn.execute(
            text(
                "SELECT prompt_id FROM run_prompts WHERE run_id = :run "
                "ORDER BY groups DESC, prompt_id LIMIT 1"
            ),
            {"run": db.run_id},
        ).scalar()
    asked = run.rows[int(run.picks(1)[0])].prompt  # step 1's first group's prompt
    user = asked.split("<|im_start|>user\n", 1)[1]
    word = max(user.split("<|im_end|>", 1)[0].split(), key=len)  # its query's longest word
    base = f"/api/runs/{db.run_id}/prompts"
    lists = {
        "": {},
        "look=never_solved": {"look": "never_solved"},
        "look=flipping": {"look": "flipping"},
        "look=stuck": {"look": "stuck"},
        "look=forgotten": {"look": "forgotten"},
        "sort=flips&order=desc": {"sort": "flips", "order": "desc"},
        "sort=true_mean": {"sort": "true_mean"},
        f"q= ({word})": {"q": word},
    }
    pages = [
        Page(f"prompts {label}".strip(), f"{base}?{urlencode(query)}", PROMPTS_MS, JSON_MB * 1000)
        for label, query in lists.items()
    ]
    pages += [
        Page("prompts heatmap data", f"{base}/heatmap", HEATMAP_MS, JSON_MB * 1000),
        Page(
            "prompts heatmap data, 500 rows",
            f"{base}/heatmap?limit=500&width=1000",
            HEATMAP_MS,
            JSON_MB * 1000,
        ),
        Page("prompts export never_solved", f"{base}/export.jsonl?look=never_solved"),
        Page("prompts page", f"/runs/{db.run_id}/prompts", PROMPTS_MS),
    ]
    if busiest is not None:
        pages += [
            Page("prompt history", f"{base}/{busiest}", HISTORY_MS, JSON_MB * 1000),
            Page(
                "prompt history, completions",
                f"{base}/{busiest}?completions=true",
                None,
                JSON_MB * 1000,
            ),
            Page("prompt page", f"/runs/{db.run_id}/prompts/{busiest}", HISTORY_MS),
        ]
    return pages


def page_list(run_id: int, step: int, group: int, names: str) -> list[Page]:
    return [
        Page("step viewer", f"/runs/{run_id}/steps/{step}", 100, STEP_PAGE_KB),
        Page("group page", f"/runs/{run_id}/steps/{step}/groups/{group}", 100),
        Page("step JSON", f"/api/runs/{run_id}/steps/{step}", None, JSON_MB * 1000),
        Page("group JSON", f"/api/runs/{run_id}/steps/{step}/groups/{group}", None, JSON_MB * 1000),
        Page("run page", f"/runs/{run_id}"),
        Page("series JSON", f"/api/runs/{run_id}/series?names={names}", None, JSON_MB * 1000),
        Page("explorer page", f"/runs/{run_id}/rollouts", 200),
    ]


def next_page(base: str, body: bytes) -> str | None:
    """The URL of the keyset page after the one `body` answered (its `next` cursor)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    cursor = None
    for holder in (data, data.get("page") if isinstance(data, dict) else None):
        if isinstance(holder, dict):
            cursor = (
                cursor or holder.get("next_url") or holder.get("next") or holder.get("next_cursor")
            )
    if cursor is None:
        return None
    if isinstance(cursor, str) and cursor.startswith(("/", "http")):  # a URL: keep its path
        parts = urlsplit(cursor)
        return parts.path + (f"?{parts.query}" if parts.query else "")
    if isinstance(cursor, str) and cursor.startswith("?"):
        return base.split("?", 1)[0] + cursor
    value = cursor if isinstance(cursor, str) else json.dumps(cursor, separators=(",", ":"))
    return f"{base}&cursor={quote(value)}"


def _total(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    total = data.get("total") if isinstance(data, dict) else None
    return f"{total:,} rows" if isinstance(total, int) else ""


class PageBench:
    """Measures pages of one database and prints a row each; remembers errors.

    `cold`, where given, answers the page once more after its warm requests, on emptied caches
    (--cold): that time is the row's first figure (a search's: the median of COLD_READS such
    answers, each after its own restart)."""

    def __init__(
        self,
        client: TestClient,
        repeat: int,
        budget: float,
        cold: Callable[[str], Answer] | None = None,
    ) -> None:
        self.client, self.repeat, self.budget, self.cold = client, repeat, budget, cold
        self.errors: list[str] = []

    def row(self, page: Page) -> Answer | None:
        times, answer, first = measure(self.client, page.url, self.repeat, self.budget)
        if self.cold is not None and answer.status == 200:
            colds = [self.cold(page.url) for _ in range(COLD_READS if "q=" in page.label else 1)]
            first = statistics.median(cold.ms for cold in colds)
            answer = next((cold for cold in colds if cold.status != 200), answer)
        if answer.status == 404:
            print(f"  {page.label:<40} {'n/a (404)':>28}")
            return None
        if answer.status != 200:
            self.errors.append(f"{page.url} answered {answer.status}: {answer.body[:300]!r}")
            print(f"  {page.label:<40} ERROR {answer.status}")
            return None
        p50, p90, size = statistics.median(times), _pct(times, 0.9), len(answer.body)
        wants, ok = [], True
        if page.ms_target is not None:
            wants.append(f"≤ {page.ms_target:.0f} ms")
            ok &= p50 <= page.ms_target
        if page.kb_target is not None:
            wants.append(f"≤ {_size(page.kb_target * 1000).replace('.0 ', ' ')}")
            ok &= size <= page.kb_target * 1000
        if self.cold is not None and "q=" in page.label:  # a search: cold ≤ COLD_TIMES × warm
            wants.append(f"cold {first / p50:.1f}× ≤ {COLD_TIMES}×")
            ok &= first <= COLD_TIMES * p50
        want = f"{', '.join(wants)} {_mark(ok)}" if wants else ""
        print(
            f"  {page.label:<40} {len(times):>3} {first:9.1f} {p50:9.1f} {p90:9.1f} {_size(size):>10}  "
            f"{want:<22} {_total(answer.body)}"
        )
        return answer


def bench_pages(
    db: Database, run: ScaleRun, plan: Plan, steps: int, words: tuple[str, str]
) -> list[str]:
    """Every page figure on `db` at `steps` steps; the errors met."""
    names = chart_names(make_session_factory(db.engine), db.run_id)
    # lost_after: no worker beats for the bench's running run; leave it running
    settings = get_settings(database_url=db.url, lost_after_seconds=10**9, server_timing=True)
    shape, step, group = run.shape, max(1, plan.steps // 2), run.shape.groups // 2
    vote = run.rows[0].target
    repeat, budget = plan.repeat, plan.budget
    first = "cold ms" if plan.cold else "first ms"
    print(f"  {'page':<40} {'n':>3} {first:>9} {'p50 ms':>9} {'p90 ms':>9} {'bytes':>10}  target")

    # The app's engine, made here as the app makes its own, so that --cold can close its
    # connections: the request after that is the database's first (its caches emptied), while
    # the app's own (templates compiled, modules imported) stay warm.
    engine = make_engine(db.url, busy_timeout_ms=settings.sqlite_busy_timeout_ms, **WEB_POOL)

    def cold(url: str) -> Answer:
        """`url` once more after --cold's command, on new database connections."""
        subprocess.run(plan.cold, shell=True, check=True)
        engine.dispose()
        return _get(client, url)

    app = create_app(settings, session_factory=make_session_factory(engine))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        bench = PageBench(client, repeat, budget, cold if plan.cold else None)
        for page in page_list(db.run_id, step, group, names):
            bench.row(page)
        for page in explorer_queries(db.run_id, steps, shape, words, vote):
            answer = bench.row(page)
            if page.label.startswith("explorer sort="):
                following = None if answer is None else next_page(page.url, answer.body)
                if following is None:
                    why = "n/a (no next cursor)" if answer else "n/a (no first page)"
                    print(f"  {'explorer second keyset page':<40} {why:>28}")
                else:
                    bench.row(Page("explorer second keyset page", following, 200, JSON_MB * 1000))
        for page in prompt_lens_pages(db, run):
            answer = bench.row(page)
            if page.label == "prompts sort=flips&order=desc" and answer is not None:
                cursor = json.loads(answer.body)["next"]  # the API's `after` for the next page
                if cursor is None:
                    print(f"  {'prompts second keyset page':<40} {'n/a (no next cursor)':>28}")
                else:
                    following = f"{page.url}&after={quote(cursor)}"
                    bench.row(Page("prompts second keyset page", following, PROMPTS_MS))
    engine.dispose()
    return bench.errors


# --- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    shape: Shape
    steps: int  # full-shape steps: write, disk and the first pages
    fill_to: int  # steps in all for the second pages
    fill_tokens: int
    repeat: int
    budget: float  # seconds a page's requests may take beyond the first two
    write_only: bool = False  # the write figures and the training thread's, then stop
    real_text: bool = False  # --real-text: real text's ids and real logprobs; write and disk only
    cold: str | None = None  # a shell command that empties the caches before a page's last read


@contextmanager
def kept_pg_database(server_url: str) -> Iterator[str]:
    """A fresh database on that server, left there (--keep: its URL is printed, for --reuse)."""
    name = f"rollout_lens_bench_{uuid.uuid4().hex[:10]}_kept"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    kept = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    print(f"  PostgreSQL database kept: {kept}")
    yield kept


def reuse_bench(plan: Plan, sqlite_file: Path, pg: str | None) -> int:
    """The pages alone, on the databases a --keep run of the same shape and --steps left at
    --fill-to steps (the 1,000-step figures again without writing a step)."""
    run = ScaleRun(plan.shape)
    words = run.words.search_words(plan.steps * plan.shape.rollouts * plan.shape.tokens)
    dbs = [
        Database(
            "SQLite",
            f"sqlite:///{sqlite_file}",
            make_engine(f"sqlite:///{sqlite_file}"),
            1,
            run.control_tokens,
        )
    ]
    if pg:
        dbs.append(Database("PostgreSQL", pg, make_engine(pg), 1, run.control_tokens))
    for db in dbs:
        upgrade(db.engine)
    with make_session_factory(dbs[0].engine)() as session:
        rollouts = int(session.execute(text("SELECT count(*) FROM rollouts")).scalar_one())
    try:
        errors = pages_section(dbs, run, plan, plan.fill_to, rollouts, words)
    finally:
        for db in dbs:
            db.engine.dispose()
    for error in errors:
        print(f"ERROR {error}")
    return 1 if errors else 0


def run_bench(plan: Plan, folder: Path, pg: str | None, keep: bool = False) -> int:
    """Every section on SQLite (and PostgreSQL); 1 if a page answered an error."""
    shape = plan.shape
    started = time.perf_counter()
    run = ScaleRun(shape)
    if plan.real_text:
        scale_real.use_real(run)
    print(
        f"== data: {shape.groups} groups × {shape.group_size} rollouts × ~{shape.tokens:,} tokens,"
        f" {len(run.control_tokens)} control tokens, a {shape.vocab:,}-token vocabulary,"
        f" {shape.prompts} prompts ({statistics.mean(len(r.prompt) for r in run.rows) / 1000:.1f}"
        " KB each)"
    )
    words = run.words.search_words(plan.steps * shape.rollouts * shape.tokens)
    print(f"  search words: {words[0]!r} (rare: some 30 uses), {words[1]!r} (in most completions)")
    sqlite_file = folder / "scale.db"
    parquet = folder / "completions"
    parquet.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        dbs = [open_database("SQLite", f"sqlite:///{sqlite_file}", run, plan.fill_to)]
        if pg:
            url = stack.enter_context(kept_pg_database(pg) if keep else pg_database(pg))
            dbs.append(open_database("PostgreSQL", url, run, plan.fill_to))
        stack.callback(lambda: [db.engine.dispose() for db in dbs])
        print("\n== write: store.write_batch, one step a transaction (ms a step)")
        written = write_steps(run, dbs, range(1, plan.steps + 1), parquet, None)
        print_write(dbs, written, plan.steps)
        if plan.write_only:
            print_training_thread(run, dbs, plan.steps + 1)
            print(f"\n== done in {(time.perf_counter() - started) / 60:.1f} min")
            return 0
        print(f"\n== disk at {plan.steps} steps")
        print_disk(dbs, written, sqlite_file, scale_real.TARGETS if plan.real_text else None)
        if plan.real_text:
            scale_real.print_floor(
                written.floor, written.rollouts, written.tokens, written.parquet_bytes
            )
            print(f"\n== done in {(time.perf_counter() - started) / 60:.1f} min")
            return 0
        errors = pages_section(dbs, run, plan, plan.steps, written.rollouts, words)
        if plan.fill_to > plan.steps:
            print(f"\n== fill to {plan.fill_to:,} steps (rollouts of ~{plan.fill_tokens} tokens)")
            filled = write_steps(
                run, dbs, range(plan.steps + 1, plan.fill_to + 1), None, plan.fill_tokens
            )
            print_write(dbs, filled, plan.fill_to - plan.steps, fill=True)
            for db in dbs:
                size = _size(database_size(db, sqlite_file))
                print(f"  {db.label} at {plan.fill_to:,} steps: {size} (no VACUUM)")
            rollouts = written.rollouts + filled.rollouts
            errors += pages_section(dbs, run, plan, plan.fill_to, rollouts, words)
    print(f"\n== done in {(time.perf_counter() - started) / 60:.1f} min")
    for error in errors:
        print(f"ERROR {error}")
    return 1 if errors else 0


def pages_section(
    dbs: list[Database],
    run: ScaleRun,
    plan: Plan,
    steps: int,
    rollouts: int,
    words: tuple[str, str],
) -> list[str]:
    errors: list[str] = []
    for db in dbs:
        preloaded = None
        if not db.url.startswith("sqlite"):
            with db.engine.begin() as conn:  # the statistics autovacuum would have gathered
                conn.execute(text("ANALYZE"))
                preloaded = str(conn.execute(text("SHOW shared_preload_libraries")).scalar())
        print(
            f"\n== pages, {db.label}, {steps:,} steps ({rollouts:,} rollouts): server time"
            f" (Server-Timing), step {max(1, plan.steps // 2)}, group {run.shape.groups // 2}"
        )
        if plan.cold and preloaded is not None:
            prewarm = "on" if "pg_prewarm" in preloaded else "off"
            print(f"  --cold: `{plan.cold}`; autoprewarm (pg_prewarm preloaded) {prewarm}")
        errors += bench_pages(db, run, plan, steps, words)
    return errors


# --- --profile ---------------------------------------------------------------------------------


def profile_write(shape: Shape, folder: Path, pg: str | None, warm: int, top: int = 20) -> int:
    """cProfile of one full-shape step's write on each database, after `warm` unprofiled steps
    (the first steps pay for most of the run's token texts): top entries by own time and by
    cumulative time."""
    run = ScaleRun(shape)
    with ExitStack() as stack:
        dbs = [open_database("SQLite", f"sqlite:///{folder / 'profile.db'}", run, warm + 1)]
        if pg:
            url = stack.enter_context(pg_database(pg))
            dbs.append(open_database("PostgreSQL", url, run, warm + 1))
        stack.callback(lambda: [db.engine.dispose() for db in dbs])
        for step in range(1, warm + 1):
            record = run.step(step)
            for db in dbs:
                db.write(record)
        record = run.step(warm + 1)
        for db in dbs:
            known = len(db.recorder.token_texts) if db.recorder else 0
            profiler = cProfile.Profile()
            profiler.enable()
            seconds = db.write(record)
            profiler.disable()
            new = len(db.recorder.token_texts) - known if db.recorder else 0
            print(
                f"\n== {db.label}: step {warm + 1} written in {seconds * 1000:.0f} ms under"
                f" cProfile ({new:,} token ids new to the run)"
            )
            _print_profile(profiler, top)
    return 0


def _print_profile(profiler: cProfile.Profile, top: int) -> None:
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(order).print_stats(top)
        lines = out.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"\n  by {order}:")
        print("\n".join(f"  {line}" for line in lines[start:] if line.strip()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pg", nargs="?", const=PG_DEFAULT, help=f"also PostgreSQL ({PG_DEFAULT})")
    parser.add_argument("--quick", action="store_true", help="a few small steps, 2 requests a page")
    parser.add_argument("--groups", type=int, help="prompts a step (64)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--prompts", type=int, default=5_000, help="the dataset's distinct prompts (5,000)"
    )
    parser.add_argument("--tokens", type=int, help="mean completion tokens a rollout (1,024)")
    parser.add_argument("--vocab", type=int, help="token ids (150,000; --real-text 50,000)")
    parser.add_argument("--ctrl", type=int, default=4, help="control tokens watched")
    parser.add_argument("--steps", type=int, help="steps at the full shape (100)")
    parser.add_argument("--fill-to", type=int, help="steps in all for the second pages (1,000)")
    parser.add_argument("--fill-tokens", type=int, help="tokens a rollout of the fill (64)")
    parser.add_argument("--repeat", type=int, help="requests a page (20; --quick 2)")
    parser.add_argument("--budget", type=float, default=4.0, help="seconds a page, past 2 requests")
    parser.add_argument("--cache", type=Path, help="keep the databases and parquet files here")
    parser.add_argument(
        "--real-text",
        action="store_true",
        help="the bytes of real text: SmolLM2's ids of English, Python and six other languages,"
        " the real model's logprobs; write and disk only, and the entropy floor (16 groups,"
        " ~512 tokens, 200 steps unless given; needs `rollout-lens build-model --real`)",
    )
    parser.add_argument(
        "--record-logprobs",
        type=int,
        nargs="?",
        const=8192,
        metavar="TOKENS",
        help="draw TOKENS tokens from the real model's distributions over real text and print"
        " their logprobs' quantiles"
        " (scale_data.RECORDED_QUANTILES), then exit",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="with --cache: keep the PostgreSQL database too (its URL is printed), for --reuse",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        metavar="SQLITE_FILE",
        help="only the pages at --fill-to steps, on a --keep run's SQLite file (and --pg URL: its"
        " kept database)",
    )
    parser.add_argument(
        "--cold",
        nargs="?",
        const="",
        metavar="COMMAND",
        help="after each page's warm requests, run this shell command, close the app's database"
        " connections and time one more request (`cold ms`); without COMMAND: restart the"
        " PostgreSQL cluster of --pg's port (pg_ctlcluster; give --pg a cluster of the bench's"
        " own, not one others use) and drop the operating system's file cache",
    )
    parser.add_argument(
        "--write-only",
        action="store_true",
        help="the write figures and the training thread's beside a busy writer, then stop",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        type=int,
        const=10,
        metavar="WARM",
        help="profile one step's write after WARM steps (10), and exit",
    )
    args = parser.parse_args(argv)
    if args.record_logprobs is not None:
        scale_real.print_recorded(args.record_logprobs)
        return 0
    quick = QUICK if args.quick else scale_real.REAL_SHAPE if args.real_text else {}

    def pick(name: str, default: int) -> int:
        value = getattr(args, name)
        return value if value is not None else quick.get(name, default)

    shape = Shape(
        groups=pick("groups", 64),
        group_size=args.group_size,
        tokens=pick("tokens", 1024),
        vocab=pick("vocab", 150_000),
        ctrl=args.ctrl,
        prompts=args.prompts,
    )
    plan = Plan(
        shape=shape,
        steps=pick("steps", 100),
        fill_to=pick("fill_to", 1000),
        fill_tokens=pick("fill_tokens", 64),
        repeat=pick("repeat", 20),
        budget=args.budget,
        write_only=args.write_only,
        real_text=args.real_text,
        cold=cold_command(args.pg) if args.cold == "" else args.cold,
    )
    if args.reuse is not None:
        return reuse_bench(plan, args.reuse, args.pg)
    if args.keep and args.cache is None:
        parser.error("--keep needs --cache (the SQLite file is kept there)")
    with _folder(args.cache) as folder:
        if args.profile is not None:
            return profile_write(shape, folder, args.pg, args.profile)
        return run_bench(plan, folder, args.pg, keep=args.keep)


def cold_command(pg: str | None) -> str:
    """--cold's default: restart the PostgreSQL cluster that listens on `pg`'s port (found with
    pg_lsclusters) and drop the operating system's file cache (root only)."""
    if pg is None:
        raise SystemExit("--cold without a COMMAND needs --pg (the cluster it restarts)")
    port = make_url(pg).port or 5432
    listed = subprocess.run(
        ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True
    ).stdout
    for line in listed.splitlines():
        version, name, listens, *_ = line.split()
        if int(listens) == port:
            return (
                f"pg_ctlcluster {version} {name} restart && sync"
                " && echo 3 > /proc/sys/vm/drop_caches"
            )
    raise SystemExit(f"--cold: no PostgreSQL cluster of this machine listens on port {port}")


@contextmanager
def _folder(cache: Path | None) -> Iterator[Path]:
    """`cache` (kept) or a temporary folder (removed)."""
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="scale-", dir=cache))
        print(f"  files kept under {folder}")
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="rollout-lens-scale-") as tmp:
        yield Path(tmp)


if __name__ == "__main__":
    sys.exit(main())
