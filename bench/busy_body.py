"""What a busy dashboard spends on bodies it refuses, against the byte cap.

1. Every write slot held (as by other trainers' bodies being written), one large body of steps
   and one export file: the answer, the time to it, the body bytes the app pulled from the
   server and the process's peak memory growth, each the median of `--repeat` sends.
2. `--senders` bodies of steps sent at once with the slots free (two are read and refused by the
   wire, the rest answered 503 unread): the answers and the peak growth, against one body's
   (the baseline, sent alone first) and against the cap. Before the 503 came ahead of the read,
   every sender's body was read whole: the growth was about `--senders` bodies.

Peak growth is VmHWM after the answers less VmRSS before them (the high-water mark reset
through /proc/self/clear_refs). The app runs under uvicorn in this process (a thread), on a
fresh SQLite file; the bodies are made before anything is measured, so the growth is the
server's (a body is sent in pieces, chunked, so the client holds no copy of it). Run it on two checkouts to compare:

    .venv/bin/python -m bench.busy_body [--mb 60] [--cap-mb 64] [--repeat 5] [--senders 16]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from rollout_lens.server.core.config import Settings
from rollout_lens.server.webapp.app import create_app

RECORDER = "record-token-busy-0123456789"
CONTROL_TOKENS = ["<a>", "<b>"]


class Counted:
    """The app, counting the body bytes it pulls from the server (its `receive`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.read = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def counted() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                self.read += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


@contextmanager
def _served(app: Any) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=60.0, help="the body's size")
    parser.add_argument("--cap-mb", type=float, default=64.0, help="ROLLOUT_LENS_RECORD_MAX_MB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--senders", type=int, default=16, help="bodies sent at once")
    args = parser.parse_args()
    body = os.urandom(int(args.mb * 2**20))
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/busy.db"
        from rollout_lens.server.store.db import make_engine
        from rollout_lens.server.store.migrate import upgrade

        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        settings = Settings(database_url=url, record_token=RECORDER, record_max_mb=args.cap_mb)
        counted = Counted(create_app(settings))
        headers = {"authorization": f"Bearer {RECORDER}"}
        with _served(counted) as base, httpx.Client(base_url=base, headers=headers) as http:
            spec = {"key": "busy-bench-0001", "name": "busy", "control_tokens": CONTROL_TOKENS}
            run_id = http.post("/api/record/runs", json=spec).json()["id"]
            slots = counted.app.state.ingest.writing
            held = [slots.acquire(blocking=False) for _ in range(8)]
            print(f"every write slot held; a {len(body):,}-byte body, median of {args.repeat}")
            print(f"{'to':<12} {'answer':>6} {'seconds':>8} {'bytes read':>12} {'peak growth':>12}")
            for to in (f"/api/record/runs/{run_id}/steps", "/api/record/import"):
                answers, seconds, reads, growths = [], [], [], []
                for _ in range(args.repeat):
                    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
                    before = _status()["VmRSS"]
                    counted.read = 0
                    start = time.perf_counter()
                    answer = http.post(to, content=_chunks(body), timeout=120)
                    seconds.append(time.perf_counter() - start)
                    growths.append(_status()["VmHWM"] - before)
                    answers.append(answer.status_code)
                    reads.append(counted.read)
                name = "steps" if to.endswith("steps") else "import"
                print(
                    f"{name:<12} {statistics.mode(answers):>6} "
                    f"{statistics.median(seconds):>8.3f} {int(statistics.median(reads)):>12,} "
                    f"{statistics.median(growths) / 2**20:>10.1f} MB"
                )
            for taken in held:
                if taken:
                    slots.release()
            _at_once(http, counted, f"/api/record/runs/{run_id}/steps", body, args)


def _chunks(body: bytes, size: int = 2**16) -> Iterator[bytes]:
    """The body sent in pieces: httpx would join a whole body into one more copy in this
    process, and the growth measured is the server's."""
    view = memoryview(body)
    for start in range(0, len(body), size):
        yield bytes(view[start : start + size])


def _peak(send: Any) -> tuple[Any, int]:
    """`send()` and the process's peak memory growth while it ran."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status()["VmRSS"]
    result = send()
    return result, _status()["VmHWM"] - before


def _at_once(http: httpx.Client, counted: Counted, to: str, body: bytes, args: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cap = args.cap_mb * 2**20
    one = statistics.median(
        _peak(lambda: http.post(to, content=_chunks(body), timeout=120))[1] for _ in range(3)
    )
    counted.read = 0
    with ThreadPoolExecutor(args.senders) as pool:
        answers, growth = _peak(
            lambda: list(
                pool.map(
                    lambda _: http.post(to, content=_chunks(body), timeout=120).status_code,
                    range(args.senders),
                )
            )
        )
    tally = ", ".join(f"{answers.count(c)} × {c}" for c in sorted(set(answers)))
    print(f"\n{args.senders} bodies of {len(body):,} bytes at once, slots free: {tally}")
    print(f"bytes read {counted.read:,} ({counted.read / len(body):.1f} bodies)")
    print(
        f"peak growth {growth / 2**20:.1f} MB: {growth / max(one, 1):.1f} × one body's alone "
        f"({one / 2**20:.1f} MB), {growth / cap:.2f} × the cap ({args.cap_mb:g} MiB)"
    )


if __name__ == "__main__":
    main()
