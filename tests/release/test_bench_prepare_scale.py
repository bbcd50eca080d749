"""bench/prepare_scale.py on one group, so that it keeps running (its figures mean little): its
pieces are checked against the tokenizer's own before they are timed."""

from __future__ import annotations

import pytest

from bench import prepare_scale


def test_the_prepare_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gguf")
    assert prepare_scale.main(["--groups", "1", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "one step: 8 completions" in out
    for part in ("token pieces", "tag layout", "step summary"):
        assert part in out
