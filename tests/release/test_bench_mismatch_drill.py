"""bench/mismatch_drill.py in its quick mode, so that it keeps running (its figures mean little)."""

from __future__ import annotations

import pytest

from bench import mismatch_drill


def test_the_drill_down_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert mismatch_drill.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "drill-down, one step (HTML)" in out and "range at its bound (JSON)" in out
    assert "the mismatch columns" in out and "read + decode 2 blobs a rollout" in out
