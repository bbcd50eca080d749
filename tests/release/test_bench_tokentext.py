"""bench/tokentext.py on a small step, so that it keeps running (its figures mean little)."""

from __future__ import annotations

import pytest

from bench import tokentext


def test_the_tokentext_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        tokentext.main(["--rollouts", "16", "--tokens", "64", "--cjk", "0.3", "--repeat", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "export of one step (16 rollouts × 64 tokens, CJK share 0.30)" in out
    assert "ratio now/before:" in out and "token_texts alone" in out
