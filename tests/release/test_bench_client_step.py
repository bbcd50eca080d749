"""bench/client_step.py on a small step, so that it keeps running (its figures mean little)."""

from __future__ import annotations

import pytest

from bench import client_step


def test_the_client_step_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--groups", "3", "--group-size", "2", "--tokens", "16", "--repeat", "1"]
    assert client_step.main(argv) == 0
    out = capsys.readouterr().out
    assert "stream: median" in out and "(1 requests)" in out
    # the group-by-group arm: the step's groups page, then one request a rollout
    assert "groups: median" in out and "(7 requests)" in out
    assert "groups ÷ stream:" in out
