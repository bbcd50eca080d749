"""Remote recording bench: trainers on machines of their own recording into one dashboard over HTTP,
through a slow, lossy link that is cut mid-run.

A database is created on the PostgreSQL server (`--pg URL`, dropped at the end) or an SQLite
file (`--sqlite`), and `rollout-lens serve` is started on it as its own process with a
recording token. Each of `--trainers` trainers is a process on a machine of its own: a network
namespace with its own address, joined to the dashboard's by a veth pair (bench/netns.py),
through a proxy on the dashboard's end of the link that adds latency and drops
(bench/tcp_proxy.py; the kernel here has no netem). It builds seeded synthetic steps of a user's
shape (bench/scale_data.py: --groups × --group-size rollouts of ~--tokens tokens, a 150k
vocabulary, 4 control tokens) and hands them to the callback's own writer (RemoteStepWriter,
BufferAndDrop) as a trainer would (bench/remote_trainer.py). Once --cut-after of the steps are
recorded, every link goes down for --cut-seconds (the cable pulled: no reset, no answer). This
process polls the dashboard's pages meanwhile (runs list, a run page, its series) with
Server-Timing on. Printed, as a table:

- steps sent, recorded, doubled and lost, every run read back from the database; a loss is
  allowed only where a recorder dropped the step (its buffer budget exceeded), and then must be
  what the recorders counted, and what the runs say;
- the cut: its length, the first step written after it, when every step handed over before the
  link came back was written;
- the link's faults: connections, cuts, stalls, refusals;
- ingest (wire bytes, steps and rollouts a second), a step's round trip (handed over → the
  dashboard's answer that it is written), the wire against the store;
- the pages' server time (p50, p95) before, while recording, during the cut and catching up,
  against their targets (p50).

    .venv/bin/python -m bench.remote [--pg [URL]] [--sqlite] [--trainers 8] [--steps 3]
        [--groups 64] [--group-size 8] [--tokens 1024] [--buffer-mb 1024] [--every 0.05]
        [--delay-ms 10] [--jitter-ms 2] [--cut-chance 0.0001] [--stall-chance 0.0005]
        [--stall-seconds 1] [--refuse-chance 0.01] [--seed 0] [--cut-seconds 10]
        [--cut-after 0.34] [--loopback] [--json FILE] [--quick]

Without CAP_NET_ADMIN (or with --loopback) the trainers run here on 127.0.0.1, through the same
proxies, the cut a stop of the proxies (connections reset); the output says so. The trainers
have addresses of their own, not cores: they share this machine's with the dashboard.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
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

from bench import netns
from bench.pages import PG_DEFAULT, pg_database
from bench.remote_store import database_bytes, read_back, recorded_steps, store_bytes
from bench.tcp_proxy import CHUNK, Faults, TcpProxy

TOKEN = "bench-record-token-0123456789"
PAGE_TARGET_MS = {"runs page": 50.0, "run page": 100.0, "series": 100.0}  # p50, server time
QUICK = {
    "trainers": 2,
    "steps": 4,
    "groups": 4,
    "tokens": 128,
    "every": 1.0,
    "cut_seconds": 3.0,
    "cut_chance": 0.02,
    "stall_chance": 0.02,
    "stall_seconds": 0.5,
    "refuse_chance": 0.05,
}
ROOT = Path(__file__).resolve().parents[1]

Pages = dict[str, list[tuple[float, float]]]  # page → (when, server ms) of each answer


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(db: str, data: Path) -> tuple[subprocess.Popen[bytes], int]:
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
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2).status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("rollout-lens serve did not start")
        time.sleep(0.2)


def _pages(base: str, stop: threading.Event, out: Pages) -> None:
    """Poll the pages (as a person at the dashboard, not through a trainer's link): the
    server's own time of each answer."""
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


def _time(out: Pages, name: str, response: httpx.Response) -> None:
    timing = response.headers.get("server-timing", "")
    if response.status_code == 200 and "dur=" in timing:
        out.setdefault(name, []).append((time.monotonic(), float(timing.split("dur=")[1])))


def _seed_run(base: str) -> None:
    """A small recorded run, so that the baseline reads a run page and its series too."""
    from bench.remote_trainer import run

    run(
        {"url": base, "token": TOKEN, "seed": 99, "steps": 3, "buffer_mb": 64, "every": 0.0}
        | {"shape": {"groups": 4, "tokens": 64}, "name": "bench baseline"}
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Cutter(threading.Thread):
    """Once `threshold` steps are recorded, every link down for `seconds`, then up again."""

    def __init__(self, db: str, threshold: int, seconds: float, links: list[Any]) -> None:
        super().__init__(daemon=True)
        self.db, self.threshold, self.seconds, self.links = db, threshold, seconds, links
        self.done = threading.Event()  # the trainers ended: no cut if it has not begun
        self.down: float | None = None
        self.up: float | None = None
        self.recorded_at_cut = 0

    def run(self) -> None:
        from rollout_lens.server.store.db import make_engine

        engine = make_engine(self.db)
        try:
            while not self.done.wait(0.2):
                recorded = recorded_steps(engine)
                if recorded >= self.threshold:
                    break
            else:
                return
        finally:
            engine.dispose()
        self.recorded_at_cut = recorded
        self.down = time.monotonic()
        for link in self.links:
            link.set(up=False)
        time.sleep(self.seconds)
        for link in self.links:
            link.set(up=True)
        self.up = time.monotonic()


class Link:
    """A trainer machine's way to the dashboard: its proxy, on a veth or on loopback."""

    def __init__(self, proxy: TcpProxy, machine: netns.Machine | None) -> None:
        self.proxy, self.machine = proxy, machine

    @property
    def url(self) -> str:
        return f"http://{self.proxy.host}:{self.proxy.port}"

    def command(self, argv: list[str]) -> list[str]:
        return argv if self.machine is None else self.machine.command(argv)

    def set(self, *, up: bool) -> None:
        if self.machine is not None:
            netns.set_link(self.machine, up)  # the cable: packets go nowhere, nothing is reset
        elif up:
            self.proxy.start()
        else:
            self.proxy.stop()  # loopback: connections reset, new ones refused


def _links(args: argparse.Namespace, port: int, stack: ExitStack) -> tuple[list[Link], str]:
    """A link a trainer, on machines of their own when namespaces can be made; and a line that
    says where the trainers run."""
    machines: list[netns.Machine | None] = [None] * args.trainers
    if args.loopback:
        where = "trainers on loopback (127.0.0.1), as asked (--loopback)"
    else:
        try:
            machines = list(stack.enter_context(netns.machines(args.trainers)))
            first = machines[0]
            assert first is not None
            where = (
                f"trainers on {args.trainers} machines of their own (network namespaces, "
                f"{first.address}…, each a veth to the dashboard's {first.dashboard_address}…)"
            )
        except netns.NoNamespaces as exc:
            where = (
                f"NO NETWORK NAMESPACES ({exc}): trainers on loopback (127.0.0.1) instead, "
                "the cut a reset of their connections"
            )
    links = []
    for i, machine in enumerate(machines):
        faults = Faults(
            delay=args.delay_ms / 1000,
            jitter=args.jitter_ms / 1000,
            cut=args.cut_chance,
            stall=args.stall_chance,
            stall_seconds=args.stall_seconds,
            refuse=args.refuse_chance,
            seed=args.seed * 1000 + i,
        )
        host = "127.0.0.1" if machine is None else machine.dashboard_address
        proxy = TcpProxy(("127.0.0.1", port), host=host, faults=faults)
        stack.callback(proxy.close)
        proxy.start()
        links.append(Link(proxy, machine))
    return links, where


def _trainers(args: argparse.Namespace, links: list[Link], stack: ExitStack) -> list[Any]:
    """Start each trainer on its machine; their processes."""
    shape = {"groups": args.groups, "group_size": args.group_size, "tokens": args.tokens}
    # the link is the only way to the dashboard: no HTTP proxy of this machine's environment
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    processes = []
    for seed, link in enumerate(links):
        job = {"url": link.url, "token": TOKEN, "seed": seed, "shape": shape}
        job |= {"steps": args.steps, "buffer_mb": args.buffer_mb, "every": args.every}
        argv = [sys.executable, "-m", "bench.remote_trainer", json.dumps(job)]
        process = subprocess.Popen(
            link.command(argv), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        stack.callback(_end, process)
        processes.append(process)
    return processes


def _end(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _results(processes: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    results = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode:
            raise SystemExit(f"a trainer failed (exit status {process.returncode})")
        result = json.loads(out.strip().splitlines()[-1])
        for key in ("handed", "written"):
            result[key] = {int(step): t for step, t in result[key].items()}
        results.append(result)
    return results


def _catch_up(results: list[dict[str, Any]], cut: Cutter) -> dict[str, float | None]:
    """The first step written after the link came back, and when every step handed over before
    then was written (seconds after it came back)."""
    if cut.up is None:
        return {"first_after": None, "caught_up": None}
    up = cut.up
    after = [t for r in results for t in r["written"].values() if t >= up]
    before = [
        r["written"][step]
        for r in results
        for step, t in r["handed"].items()
        if t < up and step in r["written"]
    ]
    return {
        "first_after": min(after) - up if after else None,
        "caught_up": max(0.0, max(before) - up) if before else None,
    }


def _phase(pages: Pages, name: str, start: float, end: float) -> list[float]:
    return [ms for t, ms in pages.get(name, []) if start <= t <= end]


def _table(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--pg", nargs="?", const=PG_DEFAULT, default=PG_DEFAULT)
    add("--sqlite", action="store_true", help="an SQLite file instead")
    add("--trainers", type=int, default=8)
    add("--steps", type=int, default=3)
    add("--groups", type=int, default=64)
    add("--group-size", type=int, default=8)
    add("--tokens", type=int, default=1024)
    add("--buffer-mb", type=float, default=1024, help="each recorder's buffer budget")
    add("--every", type=float, default=0.05, help="seconds between a trainer's steps")
    add("--delay-ms", type=float, default=10.0, help="the link's latency, each way")
    add("--jitter-ms", type=float, default=2.0)
    add("--cut-chance", type=float, default=0.0001, help=f"a connection reset, a {CHUNK} B chunk")
    add("--stall-chance", type=float, default=0.0005, help=f"a stall, a {CHUNK} B chunk")
    add("--stall-seconds", type=float, default=1.0)
    add("--refuse-chance", type=float, default=0.01, help="a new connection reset at once")
    add("--seed", type=int, default=0, help="the links' faults")
    add("--cut-seconds", type=float, default=10.0, help="every link down this long; 0: no cut")
    add("--cut-after", type=float, default=0.34, help="…once this share of steps is recorded")
    add("--loopback", action="store_true", help="trainers on 127.0.0.1, no namespaces")
    add("--json", type=Path, help="the figures, for a test")
    add("--quick", action="store_true", help=f"a small run: {QUICK}")
    return parser


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the way out through every `finally`: namespaces removed


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    per_step = args.groups * args.group_size
    total = args.trainers * args.steps
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
        server, port = _serve(db, folder / "data")
        stack.callback(server.terminate)
        base = f"http://127.0.0.1:{port}"
        links, where = _links(args, port, stack)
        label = "SQLite" if args.sqlite else "PostgreSQL"
        print(
            f"{args.trainers} trainers × {args.steps} steps of {args.groups} × "
            f"{args.group_size} rollouts × ~{args.tokens} tokens into one dashboard on {label}"
        )
        print(f"  {where}")
        # the pages before any trainer records: the baseline of the same pages, same run
        idle: Pages = {}
        _seed_run(base)
        quiet = threading.Event()
        threading.Timer(2.0 if args.quick else 8.0, quiet.set).start()
        _pages(base, quiet, idle)
        pages: Pages = {}
        stop = threading.Event()
        poller = threading.Thread(target=_pages, args=(base, stop, pages), daemon=True)
        threshold = max(1, math.ceil(args.cut_after * total))
        cutter = Cutter(db, threshold, args.cut_seconds, links)
        poller.start()
        processes = _trainers(args, links, stack)
        if args.cut_seconds > 0:
            cutter.start()
        results = _results(processes)
        cutter.done.set()
        if cutter.is_alive():
            cutter.join()
        stop.set()
        poller.join(timeout=30)
        figures = _figures(args, db, results, cutter, links, where, per_step, total)
        _print(figures, pages, idle, cutter, results, per_step, db)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
        return 0 if figures["doubled"] == 0 and figures["unaccounted"] == 0 else 1


def _figures(
    args: argparse.Namespace,
    db: str,
    results: list[dict[str, Any]],
    cut: Cutter,
    links: list[Link],
    where: str,
    per_step: int,
    total: int,
) -> dict[str, Any]:
    back = read_back(db, [r["run_id"] for r in results], args.steps, per_step)
    dropped_steps = sum(r["dropped"][0] for r in results)
    dropped_rollouts = sum(r["dropped"][1] for r in results)
    # every rollout is written, or dropped and counted once (stripped from its step, which may
    # go later): a loss is accounted for only when these agree
    unaccounted = abs(back["lost_steps"] - dropped_steps) + abs(
        back["lost_rollouts"] - dropped_rollouts
    )
    unaccounted += abs(back["runs_dropped"][0] - dropped_steps)
    unaccounted += abs(back["runs_dropped"][1] - dropped_rollouts)
    counts = [link.proxy.counts for link in links]
    return {
        "namespaces": all(link.machine is not None for link in links),
        "where": where,
        "steps_sent": total,
        "steps_recorded": back["recorded_steps"],
        "rollouts_sent": total * per_step,
        "rollouts_recorded": back["recorded_rollouts"],
        "doubled": back["doubled"],
        "lost_steps": back["lost_steps"],
        "lost_rollouts": back["lost_rollouts"],
        "dropped_by_recorders": [dropped_steps, dropped_rollouts],
        "dropped_on_runs": back["runs_dropped"],
        "unaccounted": unaccounted,
        "cut_seconds": None if cut.down is None or cut.up is None else cut.up - cut.down,
        "recorded_at_cut": cut.recorded_at_cut,
        **_catch_up(results, cut),
        "link": {
            "connections": sum(c.connections for c in counts),
            "cuts": sum(c.cuts for c in counts),
            "stalls": sum(c.stalls for c in counts),
            "refused": sum(c.refused for c in counts),
            "bytes": sum(c.bytes for c in counts),  # both ways, resent bodies included
        },
    }


def _print(
    figures: dict[str, Any],
    pages: Pages,
    idle: Pages,
    cut: Cutter,
    results: list[dict[str, Any]],
    per_step: int,
    db: str,
) -> None:
    f = figures
    lost = f"{f['lost_steps']} steps, {f['lost_rollouts']} rollouts"
    counted = f"the recorders counted {f['dropped_by_recorders'][0]} steps, "
    counted += f"{f['dropped_by_recorders'][1]} rollouts; the runs say "
    counted += f"{f['dropped_on_runs'][0]}, {f['dropped_on_runs'][1]}"
    if f["cut_seconds"] is None:
        cut_line, catch = "none (the trainers ended before it was due)", "-"
    else:
        cut_line = f"every link down {f['cut_seconds']:.1f} s, after {f['recorded_at_cut']} "
        cut_line += f"of {f['steps_sent']} steps were recorded"
        first, caught = f["first_after"], f["caught_up"]
        catch = (
            "-" if first is None else f"first step written {first:.1f} s after the link came back"
        )
        if caught is not None:
            catch += f"; every step handed over before then written {caught:.1f} s after"
    link = f["link"]
    rows = [
        ("steps sent", f"{f['steps_sent']} ({f['rollouts_sent']:,} rollouts)"),
        ("steps recorded", f"{f['steps_recorded']} ({f['rollouts_recorded']:,} rollouts)"),
        ("doubled", str(f["doubled"])),
        ("lost", f"{lost} ({counted}); unaccounted: {f['unaccounted']}"),
        ("the cut", cut_line),
        ("caught up", catch),
        (
            "the links' faults",
            f"{link['connections']} connections, {link['cuts']} cut mid-way, {link['stalls']} "
            f"stalls, {link['refused']} refused; {link['bytes'] / 2**20:,.1f} MB carried",
        ),
    ]
    started = min(t for r in results for t in r["handed"].values())
    written = [t for r in results for t in r["written"].values()]
    ended = max(written) if written else time.monotonic()
    elapsed = max(ended - started, 1e-9)
    sent = sum(r["bytes"] for r in results)
    trips = [r["written"][s] - r["handed"][s] for r in results for s in r["written"]]
    rows.append(
        (
            "ingest",
            f"{sent / 2**20 / elapsed:.1f} MB/s on the wire, {len(written) / elapsed:.2f} "
            f"steps/s, {len(written) * per_step / elapsed:,.0f} rollouts/s ({len(written)} "
            f"steps, {sent / 2**20:,.1f} MB in {elapsed:.1f} s, the cut included)",
        )
    )
    if trips:
        rows.append(
            (
                "a step's round trip",
                f"median {statistics.median(trips):.2f} s, p95 {_pct(trips, 0.95):.2f} s, max "
                f"{max(trips):.2f} s",
            )
        )
    rollouts = max(1, len(written) * per_step)
    wire_each = sent / rollouts
    arrays_each = store_bytes(db, results[0]["run_id"], 1) / per_step
    whole_each = database_bytes(db) / rollouts
    rows.append(
        (
            "the wire",
            f"{wire_each / 1024:.2f} KB a rollout (whole requests); the store: "
            f"{arrays_each / 1024:.2f} KB a rollout in rollout_data, {whole_each / 1024:.2f} KB "
            f"of the whole database; wire ÷ store {wire_each / whole_each:.2f}",
        )
    )
    _table(rows)
    phases = [("before", None), ("recording", (started, ended))]
    if cut.down is not None and cut.up is not None:
        phases.append(("in the cut", (cut.down, cut.up)))
        if f["caught_up"] is not None:
            phases.append(("catching up", (cut.up, cut.up + f["caught_up"])))
    head = "".join(f"{name:>19}" for name, _ in phases)
    print(f"  server ms, p50 / p95 (n){head}   target p50")
    for name, target in PAGE_TARGET_MS.items():
        cells, ok = "", True
        for phase, window in phases:
            values = (
                [ms for _, ms in idle.get(name, [])]
                if window is None
                else _phase(pages, name, *window)
            )
            cell = f"{_pct(values, 0.5):.0f} / {_pct(values, 0.95):.0f} ({len(values)})"
            cells += f"{cell:>19}"
            if phase == "recording":
                ok = _pct(values, 0.5) <= target
        verdict = "ok" if ok else "OVER"
        print(f"  {name:<25}{cells}   ≤ {target:.0f} ms {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
