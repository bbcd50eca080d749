"""Page bench: server time (and bytes) of the dashboard's pages on SQLite and PostgreSQL.

Data (bench/pages_data.py, written through server.store): a synthetic leaky run of 10,000 steps ×
8 rollouts whose prompts list all 64 tools, a 100-step run like it, nine more 10,000-step runs to
compare with the long one, and short runs in every state up to 1,000 runs. Filled once into an
SQLite file under --cache (about two minutes; later runs reuse it) and copied row
for row into a database created on the PostgreSQL server for --pg (dropped at the end).

It prints, from the app's own Server-Timing header through FastAPI's TestClient:
- the step viewer, the run page and its series JSON, alerts: the long run vs the short one (the
  targets: ratio ≤ 1.5, step viewer p50 ≤ 20 ms);
- the runs page and its JSON with 1,000 runs, a search, and a live poll (target ≤ 50 ms);
- the compare page and its JSON for 10 runs × 10,000 steps: time (target ≤ 100 ms), bytes, the
  bytes of chart data (target ≤ 500 KB) and what those bytes go to.

    .venv/bin/python -m bench.pages [--pg [URL]] [--quick] [--repeat 200] [--cache DIR] [--fresh]

`--quick` (well under a minute) fills small runs into a temporary file and repeats little: it
checks that the bench runs, its figures mean little. `--demo PATH` writes a small leaky-vs-patched
pair for looking at the pages instead.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import get_settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import ACTIVE_STATUSES, RunStatus
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.pages import plotly_figures
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from bench import pages_data
from bench.pages_data import FULL, QUICK, Dataset, Sizes, fill

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PAGE_DATA = re.compile(r'<script type="application/json" id="page-data">(.*?)</script>', re.S)


def _get(client: TestClient, url: str) -> tuple[float, bytes]:
    response = client.get(url)
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    timing = response.headers["server-timing"]
    return float(timing.split("dur=")[1]), response.content


def measure(client: TestClient, url: str, repeat: int) -> tuple[float, float]:
    """Median and p95 of the server's own time for `url`, in ms (after a warm-up)."""
    for _ in range(min(5, repeat)):
        _get(client, url)
    times = sorted(_get(client, url)[0] for _ in range(repeat))
    return statistics.median(times), times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _kb(n: int) -> str:
    return f"{n / 1000:,.1f} KB"


def figure_bytes(figs: list[dict[str, Any]]) -> dict[str, int]:
    """What the bytes of Plotly figures go to: data inside the traces (step axes, means, bands),
    the rest of each trace (style, names, meta) and the layouts."""
    out = {"traces: x": 0, "traces: y": 0, "traces: lo/hi": 0, "trace style": 0, "layout": 0}
    for fig in figs:
        out["layout"] += _size({k: v for k, v in fig.items() if k != "data"})
        for trace in fig["data"]:
            part = (trace.get("meta") or {}).get("part", "y")
            out["traces: x"] += _size(trace.get("x", []))
            out["traces: lo/hi" if part in ("lo", "hi") else "traces: y"] += _size(
                trace.get("y", [])
            )
            out["trace style"] += _size({k: v for k, v in trace.items() if k not in ("x", "y")})
    return out


def series_bytes(by_run: dict[str, Any]) -> dict[str, int]:
    """What the bytes of per-run series payloads go to: each part (x, y, lo, hi), the 25-step
    buckets, and the rest (names, run fields, cursors)."""
    out: dict[str, int] = {}
    for per_run in by_run.values():
        for entry in per_run["series"].values():
            for part, values in entry.items():
                out[f"series: {part}"] = out.get(f"series: {part}", 0) + _size(values)
        rest = {k: v for k, v in per_run.items() if k not in ("series", "buckets")}
        out["series: other"] = out.get("series: other", 0) + _size(rest)
        out["series: names"] = out.get("series: names", 0) + _size(list(per_run["series"]))
        if "buckets" in per_run:
            out["series: 25-step buckets"] = out.get("series: 25-step buckets", 0) + _size(
                per_run["buckets"]
            )
    return out


def compare_json_bytes(data: dict[str, Any]) -> dict[str, int]:
    """What the bytes of the compare JSON go to: its series (series_bytes), then each other key."""
    out = series_bytes(data["series"])
    for key, value in data.items():
        if key != "series":
            out[key] = _size(value)
    return out


def _breakdown(label: str, parts: dict[str, int]) -> None:
    total = sum(parts.values())
    print(f"    {label}: {_kb(total)}")
    for name, n in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"      {name:<24} {_kb(n):>12} {100 * n / max(total, 1):5.1f} %")


def _line(label: str, p50: float, p95: float, extra: str = "") -> None:
    print(f"  {label:<42} {p50:8.2f} {p95:8.2f}  {extra}")


def chart_names(factory: Any, run_id: int) -> str:
    """The series the run page asks for when it loads (its non-lazy charts)."""
    with session_scope(factory) as session:
        overview = queries.run_overview(session, run_id=run_id)
    figs = plotly_figures.run_figures(overview["run"]["control_tokens"], overview["series_names"])
    shown = [f for key in ("main", "structure", "optimization") for f in figs[key]]
    return ",".join(
        sorted({t["meta"]["series"] for f in shown for t in f["data"] if "series" in t["meta"]})
    )


def bench_database(url: str, sizes: Sizes, repeat: int) -> None:
    """Every figure on the database at `url` (already filled)."""
    engine = make_engine(url)
    factory = make_session_factory(engine)
    data = pages_data.find(factory, sizes)
    with session_scope(factory) as session:
        runs = store.list_runs(session)  # newest first
    active = [r.id for r in runs if r.status in ACTIVE_STATUSES][:50]
    names = {
        data.big: chart_names(factory, data.big),
        data.little: chart_names(factory, data.little),
    }
    # lost_after: the bench's running runs have no worker beating for them; leave them running.
    settings = get_settings(database_url=url, lost_after_seconds=10**9, server_timing=True)
    warm, cold = create_app(settings), create_app(settings, cache_size=0)
    loopback = "http://127.0.0.1"  # a host the app's Host check admits
    with TestClient(warm, base_url=loopback) as w, TestClient(cold, base_url=loopback) as c:
        _long_vs_short(w, c, data, sizes, names, repeat)
        _runs_page(w, data, runs[0].id, active, repeat)
        _compare(w, c, data, sizes, max(3, repeat // 10))
    engine.dispose()


def _long_vs_short(
    w: TestClient, c: TestClient, data: Dataset, sizes: Sizes, names: dict[int, str], repeat: int
) -> None:
    pages: dict[str, tuple[TestClient, Callable[[int, int], str]]] = {
        "step viewer (HTML)": (w, lambda r, n: f"/runs/{r}/steps/{n // 2}"),
        "step JSON": (w, lambda r, n: f"/api/runs/{r}/steps/{n // 2}"),
        "group page (HTML)": (w, lambda r, n: f"/runs/{r}/steps/{n // 2}/groups/0"),
        "group JSON": (w, lambda r, n: f"/api/runs/{r}/steps/{n // 2}/groups/0"),
        "run page (HTML)": (w, lambda r, n: f"/runs/{r}"),
        "series: run page, reload": (w, lambda r, n: f"/api/runs/{r}/series?names={names[r]}"),
        "series: run page, cold": (c, lambda r, n: f"/api/runs/{r}/series?names={names[r]}"),
        "series: live poll": (
            c,
            lambda r, n: f"/api/runs/{r}/series?names={names[r]}&since={n - 1}",
        ),
        "alerts: cold": (c, lambda r, n: f"/api/runs/{r}/alerts"),
    }
    print(f"\n  server time (Server-Timing) in ms, {repeat} requests each ({repeat // 5} cold)\n")
    print(f"  {'':<26} {f'{sizes.steps} steps':>17} {f'{sizes.small} steps':>17} {'ratio':>7}")
    print(f"  {'':<26} {'p50':>8} {'p95':>8} {'p50':>8} {'p95':>8} {'of p50':>7}")
    for label, (client, make) in pages.items():
        n = max(3, repeat // 5) if client is c else repeat
        big_p50, big_p95 = measure(client, make(data.big, sizes.steps), n)
        small_p50, small_p95 = measure(client, make(data.little, sizes.small), n)
        ratio = big_p50 / small_p50
        print(
            f"  {label:<26} {big_p50:8.2f} {big_p95:8.2f} {small_p50:8.2f} {small_p95:8.2f} {ratio:7.2f}"
        )


def _runs_page(w: TestClient, data: Dataset, newest: int, active: list[int], repeat: int) -> None:
    title = f"runs page, {data.runs} runs (ms)"
    print(f"\n  {title:<42} {'p50':>8} {'p95':>8}  bytes\n")
    urls = {
        "runs page (HTML)": "/",
        "runs JSON": "/api/runs",
        "runs page: search + sort, page 3": "/?q=sweep&sort=accuracy&order=asc&page=3",
        "runs JSON: live poll": f"/api/runs?after={newest}&ids={','.join(map(str, active))}",
    }
    for label, url in urls.items():
        p50, p95 = measure(w, url, repeat)
        _line(label, p50, p95, _kb(len(_get(w, url)[1])))


def _compare(w: TestClient, c: TestClient, data: Dataset, sizes: Sizes, repeat: int) -> None:
    ids = ",".join(map(str, data.compared))
    what = f"{len(data.compared)} runs × {sizes.steps} steps"
    title = f"compare, {what} (ms)"
    print(f"\n  {title:<42} {'p50':>8} {'p95':>8}  bytes (gzip)\n")
    bodies = {}
    for label, url in (
        ("compare page (HTML)", f"/compare?runs={ids}"),
        ("compare JSON", f"/api/compare?runs={ids}"),
    ):
        for client, kind in ((c, "cold"), (w, "unchanged runs")):
            p50, p95 = measure(client, url, repeat)
            body = _get(client, url)[1]
            bodies[label] = body
            size = f"{_kb(len(body))} ({_kb(len(gzip.compress(body, 6)))})"
            _line(f"{label}, {kind}", p50, p95, size)
    html = bodies["compare page (HTML)"].decode()
    found = PAGE_DATA.search(html)
    page = json.loads(found.group(1)) if found else {}
    charts = {k: page[k] for k in ("figures", "series") if k in page}
    chart = _size(charts)
    chart_gz = len(gzip.compress(json.dumps(charts, separators=(",", ":")).encode(), 6))
    print(f"\n  compare page: chart data (figures and series) {_kb(chart)} ({_kb(chart_gz)} gzip)")
    parts = figure_bytes(charts.get("figures", [])) | series_bytes(charts.get("series", {}))
    _breakdown("the page's chart data", parts)
    _breakdown("the JSON twin", compare_json_bytes(json.loads(bodies["compare JSON"])))


@contextmanager
def pg_database(server_url: str) -> Iterator[str]:
    """A fresh database on the PostgreSQL server at `server_url`, dropped afterwards (on a
    connection checked first: `--cold` restarts the server in between)."""
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    name = f"rollout_lens_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run(sizes: Sizes, *, repeat: int, sqlite_file: Path, pg: str | None) -> int:
    print(f"\n== SQLite ({sqlite_file})")
    bench_database(f"sqlite:///{sqlite_file}", sizes, repeat)
    if pg:
        with pg_database(pg) as url:
            print(f"\n== PostgreSQL ({make_url(url).render_as_string(hide_password=True)})")
            source = make_engine(f"sqlite:///{sqlite_file}")
            target = make_engine(url)
            upgrade(target)
            rows = pages_data.copy_database(source, target)
            source.dispose()
            target.dispose()
            print(f"  copied {rows:,} rows from the SQLite file")
            bench_database(url, sizes, repeat)
    return 0


def demo(db: Path) -> int:
    """A leaky-vs-patched pair and a failed run, for screenshots and a first look."""
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    fill(factory, steps=250, variant="leaky", seed=4, name="escalation leaky (64 tools)")
    fill(factory, steps=250, variant="patched", seed=4, name="escalation patched (top-4)")
    failed = fill(
        factory, steps=40, variant="leaky", seed=5, name="leaky lr=3e-3", status=RunStatus.failed
    )
    with session_scope(factory) as session:
        store.mark_finished(
            session,
            run_id=failed,
            status=RunStatus.failed,
            error="RuntimeError: CUDA out of memory while generating step 41",
        )
    fill(
        factory, steps=120, variant="patched", seed=6, name="patched live", status=RunStatus.running
    )
    engine.dispose()
    print(f"demo runs written to {url}")
    return 0


def _say(text: str) -> None:
    print(text, end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small runs, few repeats, no cache")
    parser.add_argument("--pg", nargs="?", const=PG_DEFAULT, help=f"also PostgreSQL ({PG_DEFAULT})")
    parser.add_argument("--repeat", type=int, help="requests per figure (200; --quick 5)")
    parser.add_argument("--steps", type=int, help="steps of the long runs (10,000; --quick 200)")
    parser.add_argument("--runs", type=int, help="runs in all (1,000; --quick 300)")
    parser.add_argument("--cache", type=Path, default=Path(".rollout-lens/bench"))
    parser.add_argument("--fresh", action="store_true", help="fill a temporary file, not the cache")
    parser.add_argument("--demo", type=Path, help="write demo runs to this SQLite file and exit")
    args = parser.parse_args(argv)
    if args.demo:
        return demo(args.demo)
    sizes = QUICK if args.quick else FULL
    sizes = replace(sizes, steps=args.steps or sizes.steps, runs=args.runs or sizes.runs)
    repeat = args.repeat or (5 if args.quick else 200)
    if args.fresh or args.quick:
        with tempfile.TemporaryDirectory(prefix="rollout-lens-bench-") as tmp:
            path = Path(tmp) / "bench.db"
            pages_data.build(f"sqlite:///{path}", sizes, say=_say)
            return run(sizes, repeat=repeat, sqlite_file=path, pg=args.pg)
    path = pages_data.cached(sizes, args.cache, say=_say)
    return run(sizes, repeat=repeat, sqlite_file=path, pg=args.pg)


if __name__ == "__main__":
    sys.exit(main())
