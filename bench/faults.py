"""Fault scenarios in a light form (no model, no torch): each injects one fault into the real
recording path and the real services, then counts what the database holds.

- database outage: a launched run's StepWriter writes to PostgreSQL through a loopback proxy
  that is cut for a few seconds (the database restarting, as the writer sees it);
- writer killed: a recording process is SIGKILLed mid-run, the run is marked lost, requeued and
  continued from its last recorded step by a second process;
- broker down: a redis-server of our own (append-only, as docker-compose runs it) is stopped
  while runs are queued: launching answers 503 and creates nothing; restarted, it still holds
  the queued runs' messages, one each;
- disk full: the recording process may not grow a file past a few hundred KB (RLIMIT_FSIZE, so
  SQLite's writes fail with EFBIG: "disk I/O error"), which works as root, unlike a read-only
  chmod; the run fails with the database's message, the steps before it intact, the web app
  serving them; the failure lands when the limit is lifted (space freed);
- two claims: two threads claim the same 50 queued runs at once (store.claim_run, what a second
  worker given the same run does first): each run is taken once.

bench/load.py prints their table; tests/e2e/test_faults.py asserts on them (and runs the same
faults against a real Celery worker training the tiny model).

    .venv/bin/python -m bench.faults [--pg-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RolloutRow, RunStatus, StepRow
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from bench.synthetic import CONTROL_TOKENS, SyntheticRun
from bench.tcp_proxy import database_proxy

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get(
    "ROLLOUT_LENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@dataclass
class FaultResult:
    """One scenario's outcome, counted in the database afterwards."""

    scenario: str
    database: str
    survived: bool  # the expected outcome: no step lost or doubled, or a clear failure
    expected: int  # steps that should be recorded
    recorded: int  # distinct steps recorded
    lost: int  # expected steps missing (a gap, or the tail)
    duplicated: int  # step or rollout rows beyond one per key
    note: str


# --- shared pieces -------------------------------------------------------------------------------


@contextlib.contextmanager
def pg_database(admin_url: str = PG_URL) -> Iterator[str]:
    """A fresh PostgreSQL database, migrated, dropped afterwards."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"rollout_lens_fault_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def new_run(factory: sessionmaker[Session], steps: int, status: RunStatus) -> int:
    with session_scope(factory) as session:
        return store.create_run(
            session,
            name="fault",
            model="tiny",
            total_steps=steps,
            group_size=8,
            control_tokens=CONTROL_TOKENS,
            status=status,
        ).id


def count_steps(factory: sessionmaker[Session], run_id: int, expected: int) -> tuple[int, int, int]:
    """(distinct steps recorded, steps missing of 1..expected, rows beyond one per key)."""
    with session_scope(factory) as session:
        steps = list(session.scalars(select(StepRow.step).where(StepRow.run_id == run_id)))
        per_step = session.execute(
            select(RolloutRow.step, func.count())
            .where(RolloutRow.run_id == run_id)
            .group_by(RolloutRow.step)
        ).all()
    distinct = set(steps)
    missing = len(set(range(1, expected + 1)) - distinct)
    doubled = (len(steps) - len(distinct)) + sum(max(0, n - 8) for _, n in per_step)
    return len(distinct), missing, doubled


def prefix_only(factory: sessionmaker[Session], run_id: int) -> bool:
    """The recorded steps are 1..k with no gap."""
    with session_scope(factory) as session:
        steps = sorted(session.scalars(select(StepRow.step).where(StepRow.run_id == run_id)))
    return steps == list(range(1, len(steps) + 1))


def record_steps(
    factory: sessionmaker[Session],
    run_id: int,
    first: int,
    last: int,
    *,
    interval: float,
    give_up_after: float,
    between: Callable[[int], None] = lambda step: None,
) -> None:
    """Steps first..last through a launched run's StepWriter, one every `interval` seconds
    (`between(step)` after each is handed over). Raises what the writer raises."""
    from rollout_lens.trainer.recorder.writer import StepWriter

    synthetic = SyntheticRun(variant="leaky", seed=run_id)
    writer = StepWriter.for_launched(
        factory,
        run_id=run_id,
        control_tokens=CONTROL_TOKENS,
        price_per_device_hour=2.0,
        give_up_after=give_up_after,
    )
    try:
        for step in range(first, last + 1):
            writer.put(synthetic.step(step))
            between(step)
            time.sleep(interval)
    finally:
        writer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the scenarios -------------------------------------------------------------------------------


def database_outage(
    pg_url: str = PG_URL, *, steps: int = 40, cut_seconds: float = 3.0
) -> FaultResult:
    """PostgreSQL goes away for `cut_seconds` under a writing run (a loopback proxy is cut)."""
    with pg_database(pg_url) as url:
        proxy, through_proxy = database_proxy(url)
        proxy.start()
        direct = make_engine(url)
        proxied = make_engine(through_proxy)
        try:
            factory = make_session_factory(direct)
            run_id = new_run(factory, steps, RunStatus.running)

            def cut(step: int) -> None:
                if step == steps // 3:
                    proxy.stop()
                    threading.Timer(cut_seconds, proxy.start).start()

            error = ""
            started = time.monotonic()
            try:
                record_steps(
                    make_session_factory(proxied),
                    run_id,
                    1,
                    steps,
                    interval=0.02,
                    give_up_after=60,
                    between=cut,
                )
            except RuntimeError as exc:
                error = str(exc)
            took = time.monotonic() - started
            recorded, lost, doubled = count_steps(factory, run_id, steps)
        finally:
            proxied.dispose()
            direct.dispose()
            proxy.close()
    survived = not error and lost == 0 and doubled == 0
    return FaultResult(
        "database away (PostgreSQL restart)",
        "postgresql",
        survived,
        steps,
        recorded,
        lost,
        doubled,
        error
        or f"cut {cut_seconds:.0f} s at step {steps // 3}; the run paused and went on ({took:.1f} s)",
    )


def writer_killed(database_url: str, *, steps: int = 30) -> FaultResult:
    """A recording process killed mid-run; marked lost, requeued, continued by another one."""
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    try:
        run_id = new_run(factory, steps, RunStatus.running)
        child = _recorder(database_url, run_id, 1, steps, interval=0.1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and count_steps(factory, run_id, steps)[0] < steps // 3:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        time.sleep(0.6)
        with session_scope(factory) as session:
            lost_ids = store.mark_lost_runs(session, stale_after=timedelta(seconds=0.5))
        killed_at, _, _ = count_steps(factory, run_id, steps)
        gapless = prefix_only(factory, run_id)
        with session_scope(factory) as session:
            store.requeue_for_resume(session, run_id=run_id)
        with session_scope(factory) as session:
            claimed = store.claim_run(session, run_id=run_id, task_id="resume")
            resume_from = store.last_step(session, run_id=run_id)
            store.truncate_after(session, run_id=run_id, step=resume_from)
        second = _recorder(database_url, run_id, resume_from + 1, steps, interval=0.01)
        second.wait(timeout=120)
        recorded, lost, doubled = count_steps(factory, run_id, steps)
    finally:
        engine.dispose()
    survived = (
        lost_ids == [run_id]
        and gapless
        and claimed
        and second.returncode == 0
        and lost == doubled == 0
    )
    return FaultResult(
        "writer killed mid-run, resumed",
        engine.dialect.name,
        survived,
        steps,
        recorded,
        lost,
        doubled,
        f"SIGKILL after {killed_at} steps (gap-free: {gapless}); marked lost, resumed from {resume_from}",
    )


def broker_down(data_dir: Path, *, queued: int = 2) -> FaultResult:
    """Redis stopped with runs queued: launch is refused (503, nothing created); restarted, the
    queued runs' messages are all there, once each."""
    from fastapi.testclient import TestClient
    from rollout_lens.server.core.config import Settings
    from rollout_lens.server.core.queue import QUEUE, make_celery
    from rollout_lens.server.webapp.app import create_app

    data_dir.mkdir(parents=True, exist_ok=True)
    database_url = f"sqlite:///{data_dir / 'broker.db'}"
    engine = make_engine(database_url)
    upgrade(engine)
    engine.dispose()
    with RedisServer(data_dir / "redis") as redis_server:
        settings = Settings(
            database_url=database_url, data_dir=data_dir, broker_url=redis_server.url
        )
        client = TestClient(create_app(settings), base_url="http://127.0.0.1")
        body = {"steps": 3, "seed": 1}

        def launch() -> Any:  # as a script does: no cookies, so no CSRF token is needed
            client.cookies.clear()
            return client.post("/api/runs", json=body)

        launched = [launch() for _ in range(queued)]
        ids = [r.json()["runs"][0]["id"] for r in launched if r.status_code == 201]
        redis_server.stop()
        refused = launch()
        engine = make_engine(database_url)
        factory = make_session_factory(engine)
        with session_scope(factory) as session:
            runs_after = len(store.list_runs(session))
        redis_server.start()
        delivered: list[int] = []
        celery = make_celery(settings)
        with (
            celery.connection_for_read() as conn,
            conn.SimpleQueue(QUEUE, no_ack=True) as q,
            contextlib.suppress(q.Empty),
        ):
            while True:  # until the queue has been empty for 2 s
                delivered.append(int(q.get(timeout=2).decode()[0][0]))
        with session_scope(factory) as session:
            claims = sum(store.claim_run(session, run_id=i, task_id=f"t{i}") for i in delivered)
        engine.dispose()
    lost = len(set(ids) - set(delivered))
    doubled = len(delivered) - len(set(delivered))
    survived = (
        len(ids) == queued
        and refused.status_code == 503
        and runs_after == queued
        and lost == doubled == 0
        and claims == queued
    )
    return FaultResult(
        "broker (Redis) stopped with runs queued",
        make_url(database_url).get_backend_name(),
        survived,
        queued,
        len(set(delivered)),
        lost,
        doubled,
        f"launch while down: {refused.status_code}, runs created: {runs_after - queued}; "
        f"after restart {len(delivered)} messages, {claims} claimed",
    )


def disk_full(data_dir: Path, *, limit: int = 256 * 1024, steps: int = 200) -> FaultResult:
    """SQLite cannot grow its files past `limit` bytes more than the migrated database holds
    (RLIMIT_FSIZE on the recording process): the run fails with
    the database's message, steps before it intact; the web app still serves them."""
    from fastapi.testclient import TestClient
    from rollout_lens.server.core.config import Settings
    from rollout_lens.server.webapp.app import create_app

    data_dir.mkdir(parents=True, exist_ok=True)
    database_url = f"sqlite:///{data_dir / 'full.db'}"
    engine = make_engine(database_url)
    upgrade(engine)
    factory = make_session_factory(engine)
    run_id = new_run(factory, steps, RunStatus.running)
    with engine.connect() as conn:  # the WAL starts empty: it is the file that must grow
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    # `limit` bytes of room past the migrated file (its size depends on SQLite's page size)
    fsize = (data_dir / "full.db").stat().st_size + limit
    child = _recorder(database_url, run_id, 1, steps, interval=0.02, fsize=fsize, give_up=1.0)
    log_lines: list[str] = []

    def read_log() -> None:
        for line in child.stderr or ():
            log_lines.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("failed after" in x for x in log_lines):
        time.sleep(0.05)
    recorded_when_full, _, _ = count_steps(factory, run_id, steps)
    client = TestClient(
        create_app(Settings(database_url=database_url, data_dir=data_dir)),
        base_url="http://127.0.0.1",
    )
    served = [
        client.get(url).status_code
        for url in ("/", f"/runs/{run_id}", f"/runs/{run_id}/steps/{max(recorded_when_full, 1)}")
    ]
    resource.prlimit(child.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)  # freed
    child.wait(timeout=90)
    reader.join(timeout=5)
    if child.stderr is not None:
        child.stderr.close()
    with session_scope(factory) as session:
        run = store.get_run(session, run_id=run_id)
        status, error = run.status, run.error or ""
    recorded, _, doubled = count_steps(factory, run_id, steps)
    gapless = prefix_only(factory, run_id)
    engine.dispose()
    clear = "disk I/O error" in error or "full" in error
    said = any("disk I/O error" in x or "full" in x for x in log_lines)
    survived = status == RunStatus.failed and clear and said and gapless and served == [200] * 3
    shown = (error.splitlines() or ["no error"])[0]
    return FaultResult(
        "disk full (SQLite file cannot grow)",
        "sqlite",
        survived,
        recorded,
        recorded,
        0 if gapless else 1,
        doubled,
        f"run {status} after {recorded} steps, error on the run: …{shown[-60:]}; "
        f"in the log: {said}; pages while full: {served}",
    )


def two_claims(database_url: str, *, runs: int = 50) -> FaultResult:
    """Two workers handed the same queued runs at once: each run is claimed exactly once."""
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    ids = [new_run(factory, 1, RunStatus.queued) for _ in range(runs)]
    barrier = threading.Barrier(2)
    won: dict[str, list[int]] = {"a": [], "b": []}
    errors: list[str] = []

    def worker(name: str) -> None:
        own = make_engine(database_url)
        own_factory = make_session_factory(own)
        barrier.wait()
        for run_id in ids:
            try:
                with session_scope(own_factory) as session:
                    if store.claim_run(session, run_id=run_id, task_id=name):
                        won[name].append(run_id)
            except Exception as exc:  # noqa: BLE001 - counted: a claim must not fail either
                errors.append(f"{type(exc).__name__}: {exc}")
        own.dispose()

    threads = [threading.Thread(target=worker, args=(n,)) for n in won]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.dispose()
    claimed = won["a"] + won["b"]
    lost = len(set(ids) - set(claimed))
    doubled = len(claimed) - len(set(claimed))
    return FaultResult(
        "two workers claim the same runs",
        make_url(database_url).get_backend_name(),
        not errors and lost == doubled == 0,
        runs,
        len(set(claimed)),
        lost,
        doubled,
        f"{len(won['a'])} + {len(won['b'])} claims of {runs} runs"
        + (f"; errors: {errors[0]}" if errors else ""),
    )


# --- the helpers' processes ----------------------------------------------------------------------


def _recorder(
    database_url: str,
    run_id: int,
    first: int,
    last: int,
    *,
    interval: float,
    fsize: int | None = None,
    give_up: float = 30.0,
) -> subprocess.Popen[str]:
    """`python -m bench.faults record ...`: records steps first..last as a launched run does;
    with `fsize` its files cannot grow past that many bytes."""

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))

    return subprocess.Popen(
        [sys.executable, "-m", "bench.faults", "record", database_url, str(run_id), str(first)]
        + [str(last), str(interval), str(give_up)],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        preexec_fn=limit,  # noqa: PLW1509 - only setrlimit, before exec
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE if fsize is not None else subprocess.DEVNULL,  # read by disk_full
        text=True,
    )


def _record_main(
    database_url: str, run_id: int, first: int, last: int, interval: float, give_up: float
) -> int:
    """The recording process: steps through StepWriter; a failure is put on the run."""
    import logging

    from rollout_lens.trainer.recorder.writer import DatabaseAway, mark_finished

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    try:
        record_steps(factory, run_id, first, last, interval=interval, give_up_after=give_up)
        mark_finished(factory, run_id, give_up, status=RunStatus.completed)
        return 0
    except RuntimeError as exc:
        with contextlib.suppress(DatabaseAway):
            mark_finished(factory, run_id, give_up, status=RunStatus.failed, error=str(exc))
        return 1
    finally:
        engine.dispose()


class RedisServer:
    """A redis-server of our own on a free loopback port (append-only, as docker-compose runs
    it), which can be stopped and started again on the same port and data."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server is not installed")

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir"]
            + [str(self.folder), "--appendonly", "yes", "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        """SIGTERM: Redis flushes its append-only file and exits, as on a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None


def run_all(pg_url: str | None) -> list[FaultResult]:
    """Every scenario, on SQLite and (when `pg_url`) PostgreSQL."""
    results = []
    with tempfile.TemporaryDirectory(prefix="rollout-lens-faults-") as tmp:
        root = Path(tmp)
        sqlite_url = f"sqlite:///{root / 'faults.db'}"
        engine = make_engine(sqlite_url)
        upgrade(engine)
        engine.dispose()
        urls = [sqlite_url]
        contexts = contextlib.ExitStack()
        with contexts:
            if pg_url:
                urls.append(contexts.enter_context(pg_database(pg_url)))
                results.append(database_outage(pg_url))
            for url in urls:
                results.append(writer_killed(url))
            results.append(broker_down(root / "broker"))
            results.append(disk_full(root / "full"))
            for url in urls:
                results.append(two_claims(url))
    return results


def print_table(results: list[FaultResult]) -> None:
    print(
        f"\n  {'fault':<40} {'database':<11} {'survived':>8} {'counted':>7} {'lost':>5} {'doubled':>7}  what happened"
    )
    for r in results:
        print(
            f"  {r.scenario:<40} {r.database:<11} {'yes' if r.survived else 'NO':>8} "
            f"{r.recorded:>7} {r.lost:>5} {r.duplicated:>7}  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        url, run_id, first, last, interval, give_up = argv[1:7]
        return _record_main(
            url, int(run_id), int(first), int(last), float(interval), float(give_up)
        )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=PG_URL, help="PostgreSQL admin URL ('' to skip)")
    args = parser.parse_args(argv)
    results = run_all(args.pg_url or None)
    print_table(results)
    return 0 if all(r.survived for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
