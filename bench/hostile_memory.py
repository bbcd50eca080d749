"""Hostile-body memory benchmark: the dashboard's peak memory for each of issue 48's bodies.

Starts `rollout-lens serve` (SQLite, recording token set, `--cap-mb` as
ROLLOUT_LENS_RECORD_MAX_MB) in a process of its own, warms it with a real step body and a real
Parquet import (so pyarrow is loaded), then sends each hostile body and prints its answer and the
server's peak memory growth for it: VmHWM after the answer less VmRSS before it (the high-water
mark is reset before each body through /proc/<pid>/clear_refs). The default sizes are the
issue's: an Arrow stream whose buffers are zstd-compressed holding one 256 MiB piece, a frame
declaring 150 MiB of zeros, six zero-token frames of 25,000 × 4,096-character pieces, 100,000
zero-token rollouts in one step, and a 21 KB Parquet file holding one 256 MiB completion, as
written and with a footer that says its columns hold 1,000 bytes (bench/parquet_lies.py).

    .venv/bin/python -m bench.hostile_memory [--cap-mb 64] [--only Parquet]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from rollout_lens.server.exchange import wire
from rollout_lens.server.exchange.export import rollout_schema
from rollout_lens.server.exchange.schema import FORMAT, META_RUN, META_STEPS, VERSION
from rollout_lens.server.store import arrays

from bench.parquet_lies import footer_lies

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20
RECORDER = "record-token-hostile-0123456789"


@dataclass
class Hostile:
    """A body and where it goes: `steps` (a recorded run's steps) or `import`."""

    to: str
    data: bytes


# --- the bodies ----------------------------------------------------------------------------------


def _ipc(table: pa.Table, compression: str | None = None) -> bytes:
    sink = io.BytesIO()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue()


def step_ipc(step: int = 1) -> bytes:
    """A step row of no values, for a run without control tokens."""
    schema = wire.STEP_SCHEMA.with_metadata(
        {"version": wire.WIRE_VERSION, "control_tokens": json.dumps([])}
    )
    table = pa.table(
        {
            "step": [step],
            "rollout_step": [step],
            "recorded_at": [datetime.now(UTC)],
            "values": [[]],
            "metrics": [[]],
        },
        schema=schema,
    )
    return _ipc(table)


def rollouts_ipc(n: int) -> bytes:
    """`n` valid rollouts of no tokens (groups of 8), their completions sent as text."""
    empty = arrays.encode_ids([])
    prompt = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(n, np.int32)), pa.array(["a prompt"], pa.large_string())
    )
    zeros = pa.array(np.zeros(n))
    table = pa.table(
        {
            "group": pa.array(np.arange(n) // 8),
            "index": pa.array(np.arange(n) % 8),
            "prompt": prompt,
            "completion": pa.array(["an answer"] * n, pa.large_string()),
            "text_rule": pa.nulls(n, pa.int32()),
            "n_tokens": pa.array(np.zeros(n, np.int32)),
            "ids": pa.array([empty] * n, pa.binary()),
            "logprobs": pa.nulls(n, pa.binary()),
            "control": pa.nulls(n, pa.binary()),
            "sum_logprob": zeros,
            "vote": pa.nulls(n, pa.large_string()),
            "target": pa.nulls(n, pa.large_string()),
            "verifier_reward": zeros,
            "true_score": pa.nulls(n, pa.float64()),
            "advantage": zeros,
            "format_valid": pa.array(np.zeros(n, bool)),
            "format_state": pa.nulls(n, pa.large_string()),
            "meta": pa.nulls(n, pa.large_string()),
            "has_tokens": pa.array(np.zeros(n, bool)),
            "generator_logprobs": pa.nulls(n, pa.binary()),
        },
        schema=wire.ROLLOUT_SCHEMA,
    )
    return _ipc(table)


def pieces_ipc(n: int, chars: int, compression: str | None = None) -> bytes:
    """`n` pieces (ids 0…n−1) of `chars` characters each."""
    table = pa.table(
        {"id": pa.array(np.arange(n)), "piece": pa.array(["a" * chars] * n, pa.large_string())},
        schema=wire.PIECES_SCHEMA,
    )
    return _ipc(table, compression)


def frame(parts: list[bytes]) -> bytes:
    raw = b"".join(struct.pack("<Q", len(p)) + p for p in parts)
    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)


def zeros_frame(size: int) -> bytes:
    """A zstd frame that says (and holds) `size` bytes of zeros, made a MiB at a time."""
    out = io.BytesIO()
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=True)
    with compressor.stream_writer(out, size=size, closefd=False) as writer:
        chunk = bytes(MB)
        for at in range(0, size, MB):
            writer.write(chunk[: min(MB, size - at)])
    return out.getvalue()


def run_header(name: str = "hostile import") -> dict[str, Any]:
    """A valid export's run header (schema.RunRecord)."""
    now = datetime.now(UTC).isoformat()
    return {
        "kind": "run",
        "format": FORMAT,
        "version": VERSION,
        "id": 1,
        "name": name,
        "status": "completed",
        "source": "callback",
        "variant": None,
        "model": "m",
        "k": None,
        "group_size": 1,
        "prompts_per_step": 1,
        "seed": 0,
        "total_steps": 1,
        "config": {},
        "control_tokens": [],
        "notes": [],
        "worker_host": None,
        "device": None,
        "device_seconds": 0.0,
        "cost": 0.0,
        "error": None,
        "dropped_steps": 0,
        "dropped_rollouts": 0,
        "current_step": 0,
        "recent_true_accuracy": None,
        "recent_reward": None,
        "created_at": now,
        "started_at": now,
        "finished_at": now,
        "heartbeat_at": now,
    }


def parquet_with_completion(chars: int) -> bytes:
    """An export file (no steps) whose one rollout's completion is `chars` times "a": a few KB,
    as Parquet's dictionary page and zstd make a run of one character."""
    schema = rollout_schema().with_metadata({META_RUN: json.dumps(run_header()), META_STEPS: ""})
    columns = [pa.nulls(1, f.type) for f in schema]
    columns[schema.get_field_index("completion")] = pa.array(
        ["a" * chars], schema.field("completion").type
    )
    sink = io.BytesIO()
    pq.write_table(pa.table(columns, schema=schema), sink, compression="zstd")
    return sink.getvalue()


@dataclass(frozen=True)
class Sizes:
    """The hostile bodies' sizes (issue 48's by default)."""

    piece_mb: int = 256
    zeros_mb: int = 150
    frames: int = 6
    pieces: int = 25_000
    rollouts: int = 100_000
    completion_mb: int = 256

    def names(self) -> list[str]:
        """The names of `hostile_bodies`'s bodies, in its order, without building them (a test
        parametrized by them builds the bodies only where it runs)."""
        return [
            f"Arrow-compressed piece of {self.piece_mb} MiB",
            f"zstd frame of {self.zeros_mb} MiB of zeros",
            f"{self.frames} zero-token frames of {self.pieces:,} pieces",
            f"{self.rollouts:,} zero-token rollouts in a step",
            f"Parquet with a {self.completion_mb} MiB completion",
            f"Parquet whose footer hides a {self.completion_mb} MiB completion",
        ]


def hostile_bodies(sizes: Sizes = Sizes()) -> dict[str, Hostile]:
    """Issue 48's bodies at `sizes`, by `Sizes.names`."""
    step, none = step_ipc(), rollouts_ipc(0)
    per_frame = [
        frame([step_ipc(s), none, pieces_ipc(sizes.pieces, wire.MAX_PIECE_CHARS)])
        for s in range(1, sizes.frames + 1)
    ]
    parquet = parquet_with_completion(sizes.completion_mb * MB)
    piece = pieces_ipc(1, sizes.piece_mb * MB, "zstd")
    bodies = [
        Hostile("steps", wire.body([frame([step, none, piece])])),
        Hostile("steps", wire.body([zeros_frame(sizes.zeros_mb * MB)])),
        Hostile("steps", wire.body(per_frame)),
        Hostile(
            "steps", wire.body([frame([step, rollouts_ipc(sizes.rollouts), pieces_ipc(0, 0)])])
        ),
        Hostile("import", parquet),
        Hostile("import", footer_lies(parquet, said=1_000)),
    ]
    return dict(zip(sizes.names(), bodies, strict=True))


# --- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serving(folder: Path, *, cap_mb: float) -> Iterator[tuple[str, int]]:
    """`rollout-lens serve` on SQLite in `folder`: (its base URL, its pid)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env |= {
        "PYTHONPATH": str(ROOT),
        "ROLLOUT_LENS_DATA_DIR": str(folder),
        "ROLLOUT_LENS_BROKER_URL": "redis://127.0.0.1:1/0",  # no local worker
        "ROLLOUT_LENS_RECORD_TOKEN": RECORDER,
        "ROLLOUT_LENS_RECORD_MAX_MB": str(cap_mb),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60  # a readiness wait, not a speed bound
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve did not listen: {proc.stderr.read()!r}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


class Dashboard:
    """A served dashboard's recording API and its process's memory."""

    def __init__(self, base: str, pid: int) -> None:
        self.pid = pid
        self.client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {RECORDER}"}, timeout=300
        )

    def close(self) -> None:
        self.client.close()

    def new_run(self, key: str) -> int:
        spec = {"key": key, "name": key, "control_tokens": []}
        answer = self.client.post("/api/record/runs", json=spec)
        answer.raise_for_status()
        run_id: int = answer.json()["id"]
        return run_id

    def send(self, run_id: int, hostile: Hostile) -> httpx.Response:
        if hostile.to == "import":
            return self.client.post("/api/record/import", content=hostile.data)
        return self.client.post(f"/api/record/runs/{run_id}/steps", content=hostile.data)

    def warm(self) -> None:
        """Load what the first recording and the first import load (pyarrow, zstandard)."""
        run_id = self.new_run("hostile-warm-up")
        good = wire.body([frame([step_ipc(1), rollouts_ipc(8), pieces_ipc(0, 0)])])
        self.send(run_id, Hostile("steps", good)).raise_for_status()
        export = self.client.get(f"/api/runs/{run_id}/export", params={"format": "parquet"})
        export.raise_for_status()
        self.send(run_id, Hostile("import", export.content)).raise_for_status()

    def peak_growth(self, run_id: int, hostile: Hostile) -> tuple[httpx.Response, int]:
        """The answer, and the server's peak memory over its RSS before the body (bytes)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status(self.pid)["VmRSS"]
        answer = self.send(run_id, hostile)
        return answer, _status(self.pid)["VmHWM"] - before

    def counts(self) -> tuple[int, int]:
        """(runs, steps of every run) as the API lists them."""
        runs = self.client.get("/api/runs").json()["runs"]
        return len(runs), sum(r.get("current_step") or 0 for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mb", type=float, default=64.0)
    parser.add_argument("--only", default="", help="the bodies whose name holds this text")
    args = parser.parse_args(argv)
    bodies = {k: v for k, v in hostile_bodies().items() if args.only in k}
    with (
        tempfile.TemporaryDirectory() as folder,
        serving(Path(folder), cap_mb=args.cap_mb) as (
            base,
            pid,
        ),
    ):
        dashboard = Dashboard(base, pid)
        dashboard.warm()
        print(f"ROLLOUT_LENS_RECORD_MAX_MB={args.cap_mb:g}; peak growth = VmHWM − VmRSS before")
        print(f"{'body':<56} {'bytes':>10} {'answer':>6} {'peak growth':>12} {'× cap':>6}")
        for i, (name, hostile) in enumerate(bodies.items()):
            run_id = dashboard.new_run(f"hostile-{i:04d}-run")
            answer, growth = dashboard.peak_growth(run_id, hostile)
            print(
                f"{name:<56} {len(hostile.data):>10,} {answer.status_code:>6} "
                f"{growth / MB:>8.0f} MiB {growth / (args.cap_mb * MB):>6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
