"""Remote recording bench: trainer processes recording at once into one dashboard over HTTP.

A database is created on the PostgreSQL server (`--pg URL`, dropped at the end) or an SQLite
file (`--sqlite`), and `rollout-lens serve` is started on it as its own process with a
recording token. `--trainers` processes each build seeded synthetic steps of a user's shape
(bench/scale_data.py: --groups × --group-size rollouts of ~--tokens tokens, a 150k vocabulary,
4 control tokens) and hand them to the callback's own writer (RemoteStepWriter, BufferAndDrop)
as a trainer would, while this process polls the dashboard's pages (runs list, a run page, its
series) with Server-Timing on. Printed:

- ingest: request bytes (the wire) a second, steps a second, rollouts a second, over the time
  from the first step handed over to the last acknowledged;
- a step's round trip (handed to the writer → the dashboard's answer that it is written):
  median, p95, max;
- lost and doubled: every run read back from the database (its steps, 1..N once each, and each
  step's rollouts);
- the wire against the store: a step's request bytes per rollout beside the bytes its rollouts'
  arrays and texts take in `rollout_data` (the store's own codec) for the same step;
- the pages' server time (p50, p95) while the trainers record, beside their targets.

    .venv/bin/python -m bench.remote [--pg [URL]] [--sqlite] [--trainers 8] [--steps 3]
        [--groups 64] [--group-size 8] [--tokens 1024] [--buffer-mb 1024] [--every 0.05]
        [--quick]

The trainers hand their steps over --every seconds apart (0.05: at once, a worst case), so a
step's round trip includes its wait behind the other trainers' steps; the trainers run on the
dashboard's machine here, sharing its cores (on a team's cluster they are elsewhere).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.pages import PG_DEFAULT, pg_database

TOKEN = "bench-record-token-0123456789"
PAGE_TARGET_MS = {"runs page": 50.0, "run page": 100.0, "series": 100.0}  # p50, server time
QUICK = {"trainers": 2, "steps": 2, "groups": 4, "tokens": 128}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(db: str, data: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env |= {
        "ROLLOUT_LENS_DATABASE_URL": db,
        "ROLLOUT_LENS_DATA_DIR": str(data),
        "ROLLOUT_LENS_RECORD_TOKEN": TOKEN,
        "ROLLOUT_LENS_SERVER_TIMING": "true",
        "ROLLOUT_LENS_BROKER_URL": "redis://127.0.0.1:6379/15",  # named: no local worker
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/api/runs", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("rollout-lens serve did not start")
        time.sleep(0.2)


def _trainer(args: tuple[str, int, dict[str, Any], int, int, float]) -> dict[str, Any]:
    """One trainer process: build steps, hand them to the remote writer, time each."""
    base, seed, shape_args, steps, buffer_mb, every = args
    from rollout_lens.trainer.recorder.remote import RemoteStepWriter
    from rollout_lens.trainer.recorder.writer import RunSpec

    from bench.scale_data import ScaleRun, Shape

    shape = Shape(**shape_args)
    run = ScaleRun(shape, seed=seed)
    spec = RunSpec(
        name=f"bench trainer {seed}",
        model="synthetic",
        total_steps=steps,
        group_size=shape.group_size,
        prompts_per_step=shape.groups,
        seed=seed,
        config={"bench": "remote"},
        control_tokens=list(shape.control_tokens),
        device="cpu",
    )
    handed: dict[int, float] = {}
    trips: list[float] = []
    done: list[float] = []

    def written(record: Any) -> None:
        now = time.perf_counter()
        trips.append(now - handed[record.step])
        done.append(now)

    writer = RemoteStepWriter(
        url=base, token=TOKEN, spec=spec, prepare=lambda raw: raw, max_bytes=buffer_mb * 2**20
    )
    writer.on_written = written
    records = [run.step(step) for step in range(1, steps + 1)]  # built first: not timed
    started = time.perf_counter()
    for record in records:
        handed[record.step] = time.perf_counter()
        writer.put(record)
        time.sleep(every)  # a training step's time
    writer.close(timeout=600)
    return {
        "run_id": writer.run_id,
        "trips": trips,
        "started": started,
        "ended": max(done) if done else time.perf_counter(),
        "bytes": writer.sent_bytes,
        "written": len(done),  # acknowledged (written by a request, or found by its retry)
        "dropped": (writer.dropped_steps, writer.dropped_rollouts),
        "rollouts": sum(len(r.rollouts) for r in records),
    }


def _pages(base: str, stop: threading.Event, out: dict[str, list[float]]) -> None:
    """Poll the pages while the trainers record: the server's own time of each answer."""
    with httpx.Client(base_url=base, timeout=30) as client:
        while not stop.is_set():
            runs = client.get("/api/runs")
            _time(out, "runs page", client.get("/"))
            listed = runs.json().get("runs", [])
            if listed:
                run_id = listed[-1]["id"]  # the first run (the baseline's: the same page)
                _time(out, "run page", client.get(f"/runs/{run_id}"))
                _time(out, "series", client.get(f"/api/runs/{run_id}/series"))
            stop.wait(0.5)


def _seed_run(base: str) -> None:
    """A small recorded run, so that the baseline reads a run page and its series too."""
    from rollout_lens.trainer.recorder.remote import RemoteStepWriter
    from rollout_lens.trainer.recorder.writer import RunSpec

    from bench.scale_data import ScaleRun, Shape

    shape = Shape(groups=4, tokens=64)
    run = ScaleRun(shape, seed=99)
    spec = RunSpec(
        name="bench baseline",
        model="synthetic",
        total_steps=3,
        group_size=shape.group_size,
        prompts_per_step=shape.groups,
        seed=99,
        config={},
        control_tokens=list(shape.control_tokens),
        device="cpu",
    )
    writer = RemoteStepWriter(url=base, token=TOKEN, spec=spec, prepare=lambda raw: raw)
    for step in (1, 2, 3):
        writer.put(run.step(step))
    writer.close(timeout=120)


def _time(out: dict[str, list[float]], name: str, response: httpx.Response) -> None:
    timing = response.headers.get("server-timing", "")
    if response.status_code == 200 and "dur=" in timing:
        out.setdefault(name, []).append(float(timing.split("dur=")[1]))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _check(db: str, results: list[dict[str, Any]], steps: int, per_step: int) -> tuple[int, int]:
    """(lost, doubled) steps and rollouts over every run, read back from the database."""
    from rollout_lens.server.store.db import make_engine
    from sqlalchemy import text

    engine = make_engine(db)
    lost = doubled = 0
    with engine.connect() as conn:
        for r in results:
            got = conn.execute(
                text("SELECT step FROM steps WHERE run_id = :r ORDER BY step"), {"r": r["run_id"]}
            ).scalars()
            recorded = list(got)
            lost += len(set(range(1, steps + 1)) - set(recorded))
            doubled += len(recorded) - len(set(recorded))
            counts = conn.execute(
                text("SELECT step, count(*) FROM rollouts WHERE run_id = :r GROUP BY step"),
                {"r": r["run_id"]},
            ).all()
            for _, n in counts:
                lost += max(0, per_step - n)
                doubled += max(0, n - per_step)
    engine.dispose()
    return lost, doubled


def _database_bytes(db: str) -> int:
    """The whole database's bytes: PostgreSQL's tables with TOAST and indexes, or the file."""
    from rollout_lens.server.store.db import make_engine
    from sqlalchemy import text

    if db.startswith("sqlite"):
        return Path(db.removeprefix("sqlite:///")).stat().st_size
    engine = make_engine(db)
    with engine.connect() as conn:
        total = conn.execute(
            text(
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
            )
        ).scalar()
    engine.dispose()
    return int(total or 0)


def _store_bytes(db: str, run_id: int, step: int) -> int:
    """Bytes of the step's rollouts' arrays and texts in rollout_data (the store's codec)."""
    from rollout_lens.server.store.db import make_engine
    from sqlalchemy import text

    engine = make_engine(db)
    length = "length" if db.startswith("sqlite") else "octet_length"
    columns = " + ".join(f"coalesce({length}(d.{c}), 0)" for c in ("ids", "logprobs", "control"))
    with engine.connect() as conn:
        total = conn.execute(
            text(
                f"SELECT sum({columns} + coalesce({length}(d.text), 0)) FROM rollout_data d "
                "JOIN rollouts r ON r.id = d.rollout_id WHERE r.run_id = :r AND r.step = :s"
            ),
            {"r": run_id, "s": step},
        ).scalar()
    engine.dispose()
    return int(total or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", nargs="?", const=PG_DEFAULT, default=PG_DEFAULT)
    parser.add_argument("--sqlite", action="store_true", help="an SQLite file instead")
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--buffer-mb", type=int, default=1024)
    parser.add_argument(
        "--every", type=float, default=0.05, help="seconds between a trainer's steps"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    shape = {"groups": args.groups, "group_size": args.group_size, "tokens": args.tokens}
    per_step = args.groups * args.group_size
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-remote-")))
        if args.sqlite:
            db = f"sqlite:///{folder / 'bench.db'}"
        else:
            db = stack.enter_context(pg_database(args.pg))
        from rollout_lens.server.store.db import make_engine
        from rollout_lens.server.store.migrate import upgrade

        engine = make_engine(db)
        upgrade(engine)
        engine.dispose()
        server, base = _serve(db, folder / "data")
        stack.callback(server.terminate)
        label = "SQLite" if args.sqlite else "PostgreSQL"
        print(
            f"{args.trainers} trainers × {args.steps} steps of {args.groups} × "
            f"{args.group_size} rollouts × ~{args.tokens} tokens into one dashboard on {label}"
        )
        # the pages before any trainer records: the baseline of the same pages, same run
        idle: dict[str, list[float]] = {}
        _seed_run(base)
        quiet = threading.Event()
        threading.Timer(8.0, quiet.set).start()
        _pages(base, quiet, idle)
        pages: dict[str, list[float]] = {}
        stop = threading.Event()
        poller = threading.Thread(target=_pages, args=(base, stop, pages), daemon=True)
        poller.start()
        jobs = [
            (base, seed, shape, args.steps, args.buffer_mb, args.every)
            for seed in range(args.trainers)
        ]
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.trainers) as pool:
            results = pool.map(_trainer, jobs)
        stop.set()
        poller.join(timeout=30)
        started = min(r["started"] for r in results)
        ended = max(r["ended"] for r in results)
        elapsed = max(ended - started, 1e-9)
        sent = sum(r["bytes"] for r in results)
        written = sum(r["written"] for r in results)
        trips = [t for r in results for t in r["trips"]]
        lost, doubled = _check(db, results, args.steps, per_step)
        dropped = [r["dropped"] for r in results]
        print(
            f"  ingest: {sent / 2**20 / elapsed:.1f} MB/s on the wire, {written / elapsed:.2f} "
            f"steps/s, {written * per_step / elapsed:,.0f} rollouts/s ({written} steps, "
            f"{sent / 2**20:,.1f} MB in {elapsed:.1f} s)"
        )
        print(
            f"  a step's round trip: median {statistics.median(trips):.2f} s, p95 "
            f"{_pct(trips, 0.95):.2f} s, max {max(trips):.2f} s"
        )
        print(
            f"  lost: {lost}, doubled: {doubled} (steps and rollouts read back; dropped by the "
            f"writers: {sum(d[0] for d in dropped)} steps, {sum(d[1] for d in dropped)} rollouts)"
        )
        rollouts = max(1, written * per_step)
        wire_each = sent / rollouts  # the requests the dashboard took, over every run
        arrays_each = _store_bytes(db, results[0]["run_id"], 1) / per_step
        whole_each = _database_bytes(db) / rollouts
        print(
            f"  the wire: {wire_each / 1024:.2f} KB a rollout (whole requests); the store: "
            f"{arrays_each / 1024:.2f} KB a rollout of arrays and text in rollout_data, "
            f"{whole_each / 1024:.2f} KB of the whole database (tables, indexes, search); "
            f"wire ÷ store {wire_each / whole_each:.2f}"
        )
        for name, values in pages.items():
            target = PAGE_TARGET_MS[name]
            ok = "ok" if _pct(values, 0.5) <= target else "OVER"
            before = idle.get(name, [])
            print(
                f"  {name:<10} while recording: p50 {_pct(values, 0.5):6.1f} ms, p95 "
                f"{_pct(values, 0.95):6.1f} ms (n={len(values)}; before: p50 "
                f"{_pct(before, 0.5):.1f} ms, p95 {_pct(before, 0.95):.1f} ms; target p50 ≤ "
                f"{target:.0f} ms) {ok}"
            )
        return 1 if lost or doubled else 0


if __name__ == "__main__":
    raise SystemExit(main())
