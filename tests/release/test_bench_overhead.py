"""bench/overhead.py's --shape option on a small shape, so the widened model and the held-back
end of turn keep working, bench/overhead_script.py's three arms and bench/writer_replay.py's
two halves (their figures are for people; a few steps here only show they run)."""

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


@pytest.mark.slow
def test_the_user_script_bench_runs_its_three_arms(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import overhead_script

    assert overhead_script.main(["--steps", "7", "--pairs", "1", "--thread"]) == 0
    out = capsys.readouterr().out
    assert "ratio callback/plain: median of pairs" in out
    assert "ratio thread/plain: median of pairs" in out and "target ≤ 1.05" in out
    assert "CPU a step, the training thread alone" in out


@pytest.mark.slow
def test_the_writer_replay_bench_replays_its_three_parts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import writer_replay

    assert writer_replay.main(["--steps", "8", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "captured 8 steps (8 records)" in out
    for part in ("judge", "read", "commit"):
        assert f"{part}: thread CPU a step" in out


def test_a_shape_names_rollouts_tokens_and_vocabulary() -> None:
    from bench.overhead import Shape, parse_shape

    assert parse_shape("64x128x32000") == Shape(64, 128, 32000)
    with pytest.raises(Exception, match="multiple of 8"):
        parse_shape("60x128x32000")
