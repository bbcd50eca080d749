"""Write-path benchmark: the recorder against the fastest plain write of the same rows, and
bytes on disk per rollout against TRL's own completions parquet.

1. Rate. Synthetic steps like a real leaky run's (a 64-tool prompt, a group of 8 rollouts with
   token ids, logprobs and control-token probabilities, ~70 per-step series) go through
   store.Recorder, one transaction per step, as the trainer's writer does. The rows it wrote are
   then read back and written again into a fresh database of the same schema by the plainest
   fastest write there is: sqlite3 `executemany` of prepared tuples (SQLite) or `COPY` (psycopg,
   PostgreSQL), also one transaction per step, with the run-row UPDATE the recorder makes. Both
   in this process, on the same machine, alternating; `ratio` = recorder rate / plain rate.
2. Size. A leaky (64 tools listed) and a patched (4 listed) run written by the recorder into one
   SQLite file, VACUUMed: bytes per rollout; and the same rollouts as TRL writes them with
   log_completions=True (one pandas parquet per step: step, prompt, completion, a column per
   reward function, advantage). Ours holds more: token ids, logprobs, control-token
   probabilities, probes, votes, true scores and every per-step series.

    .venv/bin/python -m bench.ingest [--steps 400] [--pg URL] [--quick]
    .venv/bin/python -m bench.ingest --db .rollout-lens/rollout_lens.db   # a real database's bytes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunStatus
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from bench.synthetic import CONTROL_TOKENS, SyntheticRun

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
STEP_TABLES = ("steps", "rollouts")


def _new_run(engine: Engine, name: str, variant: str) -> int:
    with session_scope(make_session_factory(engine)) as session:
        return store.create_run(
            session,
            name=name,
            model="synthetic",
            total_steps=0,
            group_size=8,
            variant=variant,
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.running,
        ).id


def record(
    engine: Engine, *, steps: int, variant: str, seed: int, batch: int = 1
) -> tuple[int, float]:
    """Write `steps` synthetic steps through the recorder, `batch` steps per transaction (the
    writer's batch when training outpaces it); (run id, seconds spent writing)."""
    run_id = _new_run(engine, f"recorder {variant}", variant)
    synthetic = SyntheticRun(variant=variant, seed=seed)
    records = [synthetic.step(step) for step in range(1, steps + 1)]  # built before the clock
    recorder: store.Recorder | None = None
    start = time.perf_counter()
    for first in range(0, len(records), batch):
        with engine.begin() as conn:
            if recorder is None:
                recorder = store.Recorder(conn, run_id=run_id, control_tokens=CONTROL_TOKENS)
            for record_ in records[first : first + batch]:
                recorder.write(conn, record_, device_seconds=0.5, price_per_hour=2.0)
    return run_id, time.perf_counter() - start


def rows_of(
    engine: Engine, run_id: int
) -> tuple[list[str], dict[str, list[str]], dict[int, dict[str, list[tuple[Any, ...]]]]]:
    """The rows the recorder wrote, by step: table → column names, step → table → rows."""
    columns: dict[str, list[str]] = {}
    by_step: dict[int, dict[str, list[tuple[Any, ...]]]] = {}
    with engine.connect() as conn:
        for table in STEP_TABLES:
            result = conn.execute(text(f"SELECT * FROM {table} WHERE run_id = :r"), {"r": run_id})
            names = [c for c in result.keys() if c != "id"]  # noqa: SIM118 - a Result, not a dict
            columns[table] = names
            for row in result.mappings():
                by_step.setdefault(row["step"], {t: [] for t in STEP_TABLES})[table].append(
                    tuple(_plain(row[c]) for c in names)
                )
    return list(STEP_TABLES), columns, by_step


def _plain(value: Any) -> Any:
    """JSON columns as their text (PostgreSQL's driver hands back dicts)."""
    return json.dumps(value) if isinstance(value, dict | list) else value


def _copy_interned(source: Engine, target: Engine) -> None:
    with source.connect() as src, target.begin() as dst:
        for table in ("prompts", "facts"):
            result = src.execute(text(f"SELECT * FROM {table}"))
            names = list(result.keys())
            rows = [dict(zip(names, map(_plain, row), strict=True)) for row in result]
            if rows:
                dst.execute(
                    text(
                        f"INSERT INTO {table} ({', '.join(names)}) "
                        f"VALUES ({', '.join(':' + n for n in names)})"
                    ),
                    rows,
                )


def plain_sqlite(path: Path, columns: dict[str, list[str]], by_step: dict, run_id: int) -> float:
    """The same rows into a fresh database with sqlite3 executemany; seconds."""
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    inserts = {
        t: f"INSERT INTO {t} ({', '.join(chr(34) + c + chr(34) for c in cols)}) VALUES ({', '.join('?' * len(cols))})"
        for t, cols in columns.items()
    }
    update = "UPDATE runs SET current_step = ?, heartbeat_at = ?, recent_reward = ? WHERE id = ?"
    start = time.perf_counter()
    for step, tables in sorted(by_step.items()):
        conn.execute("BEGIN")
        for table in STEP_TABLES:
            conn.executemany(inserts[table], tables[table])
        conn.execute(update, (step, "2026-11-30 00:00:00", 0.5, run_id))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


def plain_postgres(url: str, columns: dict[str, list[str]], by_step: dict, run_id: int) -> float:
    """The same rows into a fresh database with psycopg COPY; seconds."""
    import psycopg

    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    copies = {
        t: f"COPY {t} ({', '.join(chr(34) + c + chr(34) for c in cols)}) FROM STDIN"
        for t, cols in columns.items()
    }
    with psycopg.connect(conninfo) as conn:
        start = time.perf_counter()
        for step, tables in sorted(by_step.items()):
            with conn.transaction(), conn.cursor() as cur:
                for table in STEP_TABLES:
                    with cur.copy(copies[table]) as copy:
                        for row in tables[table]:
                            copy.write_row(row)
                cur.execute(
                    "UPDATE runs SET current_step = %s, heartbeat_at = now(), recent_reward = %s"
                    " WHERE id = %s",
                    (step, 0.5, run_id),
                )
        return time.perf_counter() - start


def rate_round(
    make_db: Callable[[str], tuple[Engine, str]],
    plain: Callable[..., float],
    steps: int,
    seed: int,
) -> tuple[float, float, float]:
    """One alternation: recorder (a step per transaction, then 10), then plain on the same rows
    (a step per transaction); rollouts/s of each."""
    engine, _ = make_db("rec")
    batched_engine, _ = make_db("batched")
    _, batched_seconds = record(batched_engine, steps=steps, variant="leaky", seed=seed, batch=10)
    batched_engine.dispose()
    run_id, rec_seconds = record(engine, steps=steps, variant="leaky", seed=seed)
    _, columns, by_step = rows_of(engine, run_id)
    n_rollouts = sum(len(t["rollouts"]) for t in by_step.values())
    target, where = make_db("plain")
    plain_run = _new_run(target, "plain", "leaky")
    _copy_interned(engine, target)  # prompts and facts the rollouts point at, untimed
    target.dispose()
    for rows in by_step.values():  # the copy points at the plain database's run
        for table in STEP_TABLES:
            i = columns[table].index("run_id")
            rows[table] = [r[:i] + (plain_run,) + r[i + 1 :] for r in rows[table]]
    engine.dispose()
    plain_seconds = plain(where, columns, by_step, plain_run)
    return n_rollouts / rec_seconds, n_rollouts / plain_seconds, n_rollouts / batched_seconds


def sqlite_dbs(folder: Path) -> Callable[[str], tuple[Engine, Any]]:
    def make(label: str) -> tuple[Engine, Any]:
        path = folder / f"{label}-{uuid.uuid4().hex[:6]}.db"
        engine = make_engine(f"sqlite:///{path}")
        upgrade(engine)
        return engine, path

    return make


def postgres_dbs(url: str, created: list[str]) -> Callable[[str], tuple[Engine, Any]]:
    admin = create_engine(url, isolation_level="AUTOCOMMIT")

    def make(label: str) -> tuple[Engine, Any]:
        name = f"rl_ingest_{label}_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        db_url = make_url(url).set(database=name).render_as_string(hide_password=False)
        engine = make_engine(db_url)
        upgrade(engine)
        return engine, db_url

    return make


def drop_postgres(url: str, names: list[str]) -> None:
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for name in names:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def rates(label: str, make_db: Callable, plain: Callable, steps: int, rounds: int) -> None:
    warm, _ = make_db("warmup")  # first-use costs (imports, statement caches) paid untimed
    record(warm, steps=12, variant="leaky", seed=99)
    warm.dispose()
    rounds_ = [rate_round(make_db, plain, steps, seed) for seed in range(rounds)]
    rec = statistics.median(r[0] for r in rounds_)
    base = statistics.median(r[1] for r in rounds_)
    batched = statistics.median(r[2] for r in rounds_)
    print(
        f"{label}: recorder {rec:,.0f} rollouts/s ({8000 / rec:.2f} ms per step of 8), "
        f"plain {base:,.0f} rollouts/s ({8000 / base:.2f} ms); ratio {rec / base:.2f}; "
        f"recorder with 10 steps per transaction {batched:,.0f} rollouts/s, ratio "
        f"{batched / base:.2f} (median of {rounds} rounds, {steps} steps each)"
    )


def trl_parquet_bytes(folder: Path, *, steps: int) -> tuple[int, int]:
    """The same rollouts as TRL's log_completions writes them: (bytes, rollouts)."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    total = rollouts = 0
    for variant, seed in (("leaky", 1), ("patched", 2)):
        synthetic = SyntheticRun(variant=variant, seed=seed)
        for step in range(1, steps + 1):
            record_ = synthetic.step(step)
            table = {
                "step": [step] * len(record_.rollouts),
                "prompt": [r.prompt for r in record_.rollouts],
                "completion": [r.completion for r in record_.rollouts],
                "correct_tool": [r.verifier_reward for r in record_.rollouts],
                "advantage": [r.advantage for r in record_.rollouts],
            }
            path = folder / f"{variant}_completions_{step:05d}.parquet"
            pd.DataFrame(table).to_parquet(path)
            total += path.stat().st_size
            rollouts += len(record_.rollouts)
    return total, rollouts


def sizes(folder: Path, *, steps: int) -> None:
    path = folder / "pair.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    for variant, seed in (("leaky", 1), ("patched", 2)):
        record(engine, steps=steps, variant=variant, seed=seed)
    with engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM rollouts")).scalar() or 1
    engine.dispose()
    import sqlite3

    raw = sqlite3.connect(path)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw.execute("VACUUM")
    raw.close()
    ours = path.stat().st_size / n
    trl_total, trl_n = trl_parquet_bytes(folder / "trl", steps=steps)
    trl = trl_total / trl_n
    print(
        f"bytes per rollout (a leaky + patched pair of {steps} steps each, {n} rollouts): "
        f"recorder {ours:,.0f} B (SQLite, VACUUMed), TRL completions parquet {trl:,.0f} B; "
        f"ratio {ours / trl:.2f}"
    )


def _rollout_rows(path: Path) -> list[tuple[Any, ...]]:
    """(run, step, prompt, completion, reward, advantage) of every rollout, read through the
    store (a completion's text may be rebuilt from its token ids)."""
    from rollout_lens.server.store.serialize import completion_ids, completion_text

    engine = make_engine(f"sqlite:///{path}")
    rows = []
    try:
        with session_scope(make_session_factory(engine)) as session:
            for run in store.list_runs(session):
                texts = store.token_texts(session, run_id=run.id)
                for r, prompt in store.iter_rollouts(session, run_id=run.id):
                    text_ = completion_text(r, completion_ids(r), texts)
                    rows.append((run.id, r.step, prompt, text_, r.verifier_reward, r.advantage))
    finally:
        engine.dispose()
    return rows


def database_sizes(path: Path, folder: Path) -> None:
    """Bytes per rollout of an existing SQLite database (a copy, VACUUMed) against the same
    rollouts written as TRL's log_completions writes them (one parquet per run and step)."""
    import shutil
    import sqlite3

    import pandas as pd

    copy = folder / "copy.db"
    shutil.copy(path, copy)
    for suffix in ("-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            shutil.copy(f"{path}{suffix}", f"{copy}{suffix}")
    raw = sqlite3.connect(copy)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw.execute("VACUUM")
    n = raw.execute("SELECT count(*) FROM rollouts").fetchone()[0] or 1
    raw.close()
    trl_bytes = 0
    rows = _rollout_rows(path)
    by_file: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    for row in rows:
        by_file.setdefault((row[0], row[1]), []).append(row)
    for (run_id, step), members in by_file.items():
        out = folder / f"run{run_id}_completions_{step:05d}.parquet"
        pd.DataFrame(
            {
                "step": [step] * len(members),
                "prompt": [m[2] for m in members],
                "completion": [m[3] for m in members],
                "reward": [m[4] for m in members],
                "advantage": [m[5] for m in members],
            }
        ).to_parquet(out)
        trl_bytes += out.stat().st_size
    ours = copy.stat().st_size / n
    print(
        f"bytes per rollout of {path} ({n} rollouts): recorder {ours:,.0f} B (VACUUMed), TRL "
        f"completions parquet {trl_bytes / n:,.0f} B; ratio {ours / (trl_bytes / n):.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pg", default=PG_DEFAULT, help="a PostgreSQL URL ('' to skip)")
    parser.add_argument("--quick", action="store_true", help="a few seconds: CI keeps it working")
    parser.add_argument("--db", type=Path, help="only measure this SQLite database's bytes")
    args = parser.parse_args(argv)
    if args.db:
        with tempfile.TemporaryDirectory() as tmp:
            database_sizes(args.db, Path(tmp))
        return 0
    steps, rounds = (40, 1) if args.quick else (args.steps, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rates("SQLite", sqlite_dbs(folder), plain_sqlite, steps, rounds)
        if args.pg:
            created: list[str] = []
            try:
                rates("PostgreSQL", postgres_dbs(args.pg, created), plain_postgres, steps, rounds)
            finally:
                drop_postgres(args.pg, created)
        sizes(folder, steps=steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
