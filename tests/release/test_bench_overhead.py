"""bench/overhead.py's --shape option on a small shape, so the widened model and the held-back
end of turn keep working (its figures are for people; a few steps here only show it runs)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


@pytest.mark.slow
def test_the_overhead_bench_runs_at_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import overhead

    overhead.main(["--shape", "16x12x2000", "--steps", "7", "--rounds", "1", "--arm", "callback"])
    out = capsys.readouterr().out
    assert "16 rollouts x 12 tokens a step, a 2,000-token vocabulary" in out
    assert "ratio callback/plain: median" in out and "target ≤ 1.05" in out


def test_a_shape_names_rollouts_tokens_and_vocabulary() -> None:
    from bench.overhead import Shape, parse_shape

    assert parse_shape("64x128x32000") == Shape(64, 128, 32000)
    with pytest.raises(Exception, match="multiple of 8"):
        parse_shape("60x128x32000")
