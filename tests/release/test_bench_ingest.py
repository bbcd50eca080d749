"""bench/ingest.py in its --quick mode, so the write-path benchmark cannot rot (its figures are
printed for people, not asserted: these machines are too noisy for timed tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[2]


def test_ingest_bench_quick_prints_rates_and_sizes() -> None:
    pytest.importorskip("pandas")  # writes TRL's parquet files as TRL does, with pandas
    done = subprocess.run(
        [sys.executable, "-m", "bench.ingest", "--quick", "--pg", PG_URL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for label in ("SQLite", "PostgreSQL"):
        line = next(line for line in out.splitlines() if line.startswith(f"{label}:"))
        assert re.search(r"recorder [\d,]+ rollouts/s .* plain [\d,]+ rollouts/s .* ratio \d", line)
    sizes = next(line for line in out.splitlines() if line.startswith("bytes per rollout"))
    ours, trl = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) B", sizes))
    assert ours > 0 and trl > 0
