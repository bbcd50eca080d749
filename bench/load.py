"""Concurrent load: 50 clients poll a live run while it records a step every 100 ms.

Against a real `rollout-lens serve` (a uvicorn subprocess on loopback), on SQLite (WAL) and on
PostgreSQL: a recorder process writes a step (8 rollouts, a 64-tool prompt, ~40 series) every
~100 ms through store.record_step in a session scope, as a launched run's writer does, while
asyncio clients (httpx, bounded by --clients) each loop over the run page's live poll
(`/api/runs/{id}/series?since=<cursor>`), the step viewer of the newest step and the runs page.
Prints p50/p95/p99 latency (client side, and the server's own time from Server-Timing),
requests/s and errors per endpoint, the recorder's write times and errors, and counts "database
is locked" anywhere (responses, recorder, server log). Then the fault table (bench/faults.py).

    .venv/bin/python -m bench.load                      # 60 s, 50 clients, both databases, faults
    .venv/bin/python -m bench.load --quick --db sqlite  # ~10 s, 10 clients (tests/e2e/test_load.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rollout_lens.server import store
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunStatus

from bench import faults
from bench.pages_data import fill
from bench.synthetic import CONTROL_TOKENS, SyntheticRun

ROOT = Path(__file__).resolve().parent.parent
LOCKED = "database is locked"
ENDPOINTS = ("series poll", "step viewer", "runs page")


@dataclass
class Samples:
    """Latencies (ms) and failures of one endpoint."""

    client_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class LoadResult:
    database: str
    seconds: float
    clients: int
    endpoints: dict[str, Samples]
    writer: dict[str, Any]
    server_log_errors: list[str]
    load_before: float = 0.0  # the machine's 1-minute load average (shared machines vary)
    load_after: float = 0.0

    @property
    def requests(self) -> int:
        return sum(len(s.client_ms) + len(s.errors) for s in self.endpoints.values())

    @property
    def errors(self) -> int:
        return (
            sum(len(s.errors) for s in self.endpoints.values())
            + len(self.writer.get("errors", []))
            + len(self.server_log_errors)
        )

    @property
    def locked(self) -> int:
        texts = [e for s in self.endpoints.values() for e in s.errors]
        texts += self.writer.get("errors", []) + self.server_log_errors
        return sum(LOCKED in t for t in texts)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


# --- the recorder process ------------------------------------------------------------------------


def record_main(database_url: str, run_id: int, first: int, interval: float) -> int:
    """Write a step every `interval` s until SIGTERM; print what happened as one JSON line."""
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    synthetic = SyntheticRun(variant="leaky", seed=run_id)
    times: list[float] = []
    errors: list[str] = []
    step = first
    recorder: store.Recorder | None = None
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    print("ready", flush=True)
    next_at = time.monotonic()
    while not stop:
        record = synthetic.step(step)
        started = time.perf_counter()
        try:
            with session_scope(factory) as session:
                # The recorder is kept between steps, as a launched run's writer keeps it.
                recorder = store.record_step(
                    session,
                    run_id=run_id,
                    record=record,
                    control_tokens=CONTROL_TOKENS,
                    recorder=recorder,
                )
                store.add_device_time(session, run_id=run_id, seconds=0.1, price_per_hour=2.0)
            times.append((time.perf_counter() - started) * 1000)
            step += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported, the load goes on
            recorder = None  # its memory may be ahead of what was committed
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    engine.dispose()
    print(json.dumps({"steps": step - first, "write_ms": times, "errors": errors}))
    return 0


# --- the clients ---------------------------------------------------------------------------------


async def client_loop(
    http: httpx.AsyncClient, run_id: int, deadline: float, samples: dict[str, Samples]
) -> None:
    """One dashboard user: the live poll, the newest step in the viewer, the runs page, again."""
    cursor = 0
    while time.monotonic() < deadline:
        for endpoint in ENDPOINTS:
            if endpoint == "series poll":
                url = f"/api/runs/{run_id}/series?since={cursor}"
            elif endpoint == "step viewer":
                url = f"/runs/{run_id}/steps/{max(cursor, 1)}"
            else:
                url = "/"
            started = time.perf_counter()
            try:
                response = await http.get(url)
            except httpx.HTTPError as exc:
                samples[endpoint].errors.append(f"{type(exc).__name__}: {exc}")
                continue
            elapsed = (time.perf_counter() - started) * 1000
            if response.status_code != 200 or LOCKED in response.text:
                samples[endpoint].errors.append(
                    f"{url}: {response.status_code} {response.text[:200]}"
                )
                continue
            samples[endpoint].client_ms.append(elapsed)
            timing = response.headers.get("server-timing", "")
            if "dur=" in timing:
                samples[endpoint].server_ms.append(float(timing.split("dur=")[1]))
            if endpoint == "series poll":
                cursor = max(cursor, int(response.json().get("cursor") or 0))


async def drive(base_url: str, run_id: int, clients: int, seconds: float) -> dict[str, Samples]:
    samples = {e: Samples() for e in ENDPOINTS}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0) as http:
        # Warm-up, not measured: the first request of each page compiles its templates.
        for url in (f"/api/runs/{run_id}/series", f"/runs/{run_id}/steps/1", "/"):
            (await http.get(url)).raise_for_status()
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(client_loop(http, run_id, deadline, samples) for _ in range(clients))
        )
    return samples


# --- one database --------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(database_url: str, data_dir: Path) -> Iterator[tuple[str, Path]]:
    """`rollout-lens serve` on a free loopback port; yields its URL and log file."""
    port = faults.free_port()
    log = data_dir / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")} | {
        "PYTHONPATH": str(ROOT),
        "ROLLOUT_LENS_DATABASE_URL": database_url,
        "ROLLOUT_LENS_DATA_DIR": str(data_dir),
        # A broker URL so that serve starts no local worker (nothing here launches a run).
        "ROLLOUT_LENS_BROKER_URL": "redis://127.0.0.1:6379/11",
        "ROLLOUT_LENS_SERVER_TIMING": "true",  # the server's own time, read from each answer
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/runs", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def seed(database_url: str, *, history: int = 200, others: int = 10) -> int:
    """Finished runs for the runs page (a `history`-step one and `others` short ones), and the
    live run the recorder writes to."""
    engine = make_engine(database_url)
    upgrade(engine)
    factory = make_session_factory(engine)
    fill(factory, steps=history, variant="leaky", seed=1, name=f"leaky {history}")
    for i in range(others):
        fill(factory, steps=10, variant="patched", seed=10 + i, name=f"patched {i}")
    live = fill(factory, steps=5, variant="leaky", seed=2, name="live", status=RunStatus.running)
    with session_scope(factory) as session:
        store.heartbeat(session, run_id=live)
    engine.dispose()
    return live


def run_load(
    database_url: str,
    data_dir: Path,
    *,
    clients: int,
    seconds: float,
    interval: float,
    small: bool = False,
) -> LoadResult:
    """The load on one database: serve + recorder + clients; everything measured. `small`
    seeds fewer other runs (the quick form)."""
    run_id = seed(database_url, history=30, others=3) if small else seed(database_url)
    load_before = os.getloadavg()[0]
    with serving(database_url, data_dir) as (url, log):
        recorder = subprocess.Popen(
            [sys.executable, "-m", "bench.load", "record", database_url, str(run_id), "6"]
            + [str(interval)],
            cwd=ROOT,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert recorder.stdout is not None
        if recorder.stdout.readline().strip() != "ready":  # recording from now until SIGTERM
            raise RuntimeError("the recorder did not start")
        started = time.monotonic()
        samples = asyncio.run(drive(url, run_id, clients, seconds))
        recorder.send_signal(signal.SIGTERM)
        out, _ = recorder.communicate(timeout=120)
        recording = time.monotonic() - started  # the steps' rate is over the recording time
        log_text = log.read_text(errors="replace")
    writer = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"errors": ["no output"]}
    writer["seconds"] = recording
    lines = log_text.splitlines()
    server_errors = [
        # a traceback with what follows it (its frames and its error), so a failure says why
        "\n".join(lines[i : i + 90]) if "Traceback" in line else line
        for i, line in enumerate(lines)
        if LOCKED in line or "Traceback" in line or " 500 " in line or "ERROR" in line
    ]
    return LoadResult(
        database=database_url.split(":")[0].split("+")[0],
        seconds=seconds,
        clients=clients,
        endpoints=samples,
        writer=writer,
        server_log_errors=server_errors,
        load_before=load_before,
        load_after=os.getloadavg()[0],
    )


def print_result(r: LoadResult, interval: float) -> None:
    print(
        f"\n  {r.database}: {r.clients} clients for {r.seconds:.0f} s while a step is recorded "
        f"every {interval * 1000:.0f} ms ({os.cpu_count()} CPUs, load average "
        f"{r.load_before:.1f} before, {r.load_after:.1f} after; latencies in ms)"
    )
    print(
        f"  {'endpoint':<14} {'requests':>9} {'req/s':>7} {'p50':>8} {'p95':>8} {'p99':>8}"
        f"   {'server p50':>10} {'p99':>7} {'errors':>7}"
    )
    for name, s in r.endpoints.items():
        ok = len(s.client_ms)
        print(
            f"  {name:<14} {ok + len(s.errors):>9} {ok / r.seconds:>7.1f} "
            f"{percentile(s.client_ms, 50):>8.1f} {percentile(s.client_ms, 95):>8.1f} "
            f"{percentile(s.client_ms, 99):>8.1f}   {percentile(s.server_ms, 50):>10.1f} "
            f"{percentile(s.server_ms, 99):>7.1f} {len(s.errors):>7}"
        )
    every = [t for s in r.endpoints.values() for t in s.client_ms]
    print(
        f"  {'all':<14} {r.requests:>9} {len(every) / r.seconds:>7.1f} "
        f"{percentile(every, 50):>8.1f} {percentile(every, 95):>8.1f} {percentile(every, 99):>8.1f}"
    )
    w = r.writer
    times = w.get("write_ms", [])
    print(
        f"  recorder: {w.get('steps', 0)} steps written ({w.get('steps', 0) / w.get('seconds', r.seconds):.1f}/s), "
        f"write p50 {percentile(times, 50):.1f} ms, p95 {percentile(times, 95):.1f} ms, "
        f"p99 {percentile(times, 99):.1f} ms, errors {len(w.get('errors', []))}"
    )
    print(
        f'  errors in all: {r.errors} ("{LOCKED}": {r.locked}; server log lines: '
        f"{len(r.server_log_errors)})"
    )
    for sample in [e for s in r.endpoints.values() for e in s.errors][:3] + r.server_log_errors[:3]:
        print(f"    e.g. {sample[:160]}")
    if times:
        print(f"  (mean write {statistics.fmean(times):.1f} ms)")


def load_on(
    database: str,
    *,
    clients: int,
    seconds: float,
    interval: float,
    pg_url: str,
    small: bool = False,
) -> LoadResult:
    """run_load on a fresh SQLite file or a fresh PostgreSQL database."""
    with tempfile.TemporaryDirectory(prefix=f"rollout-lens-load-{database}-") as tmp:
        data_dir = Path(tmp)
        with contextlib.ExitStack() as stack:
            if database == "sqlite":
                url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
            else:
                url = stack.enter_context(faults.pg_database(pg_url))
            return run_load(
                url, data_dir, clients=clients, seconds=seconds, interval=interval, small=small
            )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        url, run_id, first, interval = argv[1:5]
        return record_main(url, int(run_id), int(first), float(interval))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--clients", type=int, default=None, help="default 50 (quick: 10)")
    parser.add_argument("--seconds", type=float, default=None, help="default 60 (quick: 10)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between steps")
    parser.add_argument("--quick", action="store_true", help="~10 s, 10 clients, no fault table")
    parser.add_argument("--no-faults", action="store_true", help="skip the fault table")
    parser.add_argument("--pg-url", default=faults.PG_URL, help="PostgreSQL admin URL")
    args = parser.parse_args(argv)
    clients = args.clients or (10 if args.quick else 50)
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    databases = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    results = []
    for database in databases:
        result = load_on(
            database,
            clients=clients,
            seconds=seconds,
            interval=args.interval,
            pg_url=args.pg_url,
            small=args.quick,
        )
        print_result(result, args.interval)
        results.append(result)
    failed = sum(r.errors for r in results)
    if not (args.quick or args.no_faults):
        print("\n  faults (bench/faults.py: injected into the real recording path, counted after)")
        table = faults.run_all(args.pg_url if "postgres" in databases else None)
        faults.print_table(table)
        failed += sum(not r.survived for r in table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
