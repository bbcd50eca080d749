"""bench/remote.py in its --quick mode on both databases, so the remote-recording bench cannot
rot: it exits 0 only when nothing was lost or doubled (its speed figures are printed for people,
not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("where", ["--sqlite", pytest.param("--pg", marks=pytest.mark.postgres)])
def test_remote_bench_quick_loses_and_doubles_nothing(where: str) -> None:
    argv = [where] if where == "--sqlite" else [where, PG_URL]
    done = subprocess.run(
        [sys.executable, "-m", "bench.remote", "--quick", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "lost: 0, doubled: 0" in out
    for label in ("ingest:", "round trip:", "the wire:", "runs page", "run page", "series"):
        assert label in out, out
