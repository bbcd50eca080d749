"""bench/scale.py in its --quick mode on SQLite and on PostgreSQL, so the scale bench keeps
running as the write path and the pages change under it. Its figures are printed for people, not
asserted (timed tests on a shared machine mean little): only its sections and figure names."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import scale
from tests.conftest import PG_URL

SECTIONS = ("== data", "== write", "== disk at 4 steps", "== fill to 10 steps")
PAGES = (
    "step viewer",
    "group page",
    "step JSON",
    "group JSON",
    "run page",
    "series JSON",
    "explorer page",
    "explorer steps=A:B",
    "explorer q= rare",
    "explorer q= common",
    "explorer sort=advantage&order=desc",
    "explorer second keyset page",
    "prompts look=never_solved",
    "prompts q=",
    "prompts second keyset page",
    "prompts heatmap data",
    "prompt history",
    "prompts export never_solved",
)


def _check(out: str, databases: tuple[str, ...]) -> None:
    for heading in SECTIONS:
        assert heading in out, heading
    for database in databases:
        writes = out.split("== write", 1)[1].split("\n== ", 1)[0]
        assert f"  {database} " in writes, database
        for steps in ("4 steps", "10 steps"):
            section = out.split(f"== pages, {database}, {steps}", 1)[1].split("\n== ", 1)[0]
            for figure in PAGES:
                assert figure in section, (database, steps, figure)
    for figure in ("median", "p90", "M tokens/s", "TRL parquet", "TRL completions parquet"):
        assert figure in out, figure
    assert "SQLite, after VACUUM" in out and "× parquet" in out
    assert "a rollout's text, binary and JSON columns:" in out


def test_the_scale_bench_runs_on_sqlite(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pandas")  # writes TRL's parquet files as TRL does, with pandas
    assert scale.main(["--quick"]) == 0
    _check(capsys.readouterr().out, ("SQLite",))


@pytest.mark.postgres
def test_the_scale_bench_runs_on_postgres(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pandas")  # writes TRL's parquet files as TRL does, with pandas
    assert scale.main(["--quick", "--pg", PG_URL]) == 0
    out = capsys.readouterr().out
    _check(out, ("SQLite", "PostgreSQL"))
    assert "PostgreSQL, tables+TOAST+indexes" in out


def test_the_profile_mode_prints_the_write_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.main(["--profile", "2", "--groups", "2", "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "step 3 written in" in out and "token ids new to the run" in out
    assert "write_batch" in out


def test_the_second_keyset_page_follows_the_next_cursor_however_it_is_given() -> None:
    base = "/api/runs/1/rollouts?sort=advantage&order=desc"
    assert scale.next_page(base, b'{"rows": [], "next": null}') is None
    assert scale.next_page(base, b"<html>") is None
    assert scale.next_page(base, b'{"next": "k 1"}') == f"{base}&cursor=k%201"
    assert scale.next_page(base, b'{"page": {"next": "?cursor=2"}}') == (
        "/api/runs/1/rollouts?cursor=2"
    )
    follow = b'{"next": "http://127.0.0.1/api/runs/1/rollouts?cursor=3"}'
    assert scale.next_page(base, follow) == "/api/runs/1/rollouts?cursor=3"


def test_cold_runs_its_command_before_each_pages_last_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--reuse with --cold: every page that answered is read once more after the command (here
    one that counts itself), a search COLD_READS times, and its row's first figure is that
    read's (a search's: their median)."""
    pytest.importorskip("pandas")
    assert scale.main(["--quick", "--fill-to", "4", "--cache", str(tmp_path), "--keep"]) == 0
    capsys.readouterr()
    (sqlite_file,) = tmp_path.glob("scale-*/scale.db")
    calls = tmp_path / "calls"
    argv = ["--quick", "--fill-to", "4", "--reuse", str(sqlite_file)]
    assert scale.main([*argv, "--cold", f"echo cold >> {calls}"]) == 0
    out = capsys.readouterr().out
    section = out.split("== pages, SQLite, 4 steps", 1)[1]
    lines = section.splitlines()
    rows = [line for line in lines if line.startswith("  ") and not line.startswith("  page ")]
    answered = [line for line in rows if "n/a" not in line and "ERROR" not in line]
    assert "cold ms" in section and "first ms" not in section
    assert len(answered) >= len(PAGES)
    searches = [line for line in answered if "q=" in line]
    assert searches
    extra = (scale.COLD_READS - 1) * len(searches)
    assert calls.read_text().count("cold\n") == len(answered) + extra


def test_the_real_text_bench_prints_bytes_against_the_parquet_and_the_floor(
    capsys: pytest.CaptureFixture[str], real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--real-text on SQLite (a few small steps): the databases' bytes a rollout against TRL's
    parquet, where they go, and the order-0 entropy floor beside them (the real model's
    tokenizer built by the fixture, as the real model's tests have it)."""
    pytest.importorskip("pandas")

    monkeypatch.setenv("ROLLOUT_LENS_MODEL_CACHE_DIR", str(real_model_dir.parent))
    argv = ["--real-text", "--steps", "2", "--groups", "2", "--tokens", "64"]
    assert scale.main(argv) == 0
    out = capsys.readouterr().out
    assert "real text:" in out and "zh_CN" in out
    assert "SQLite, after VACUUM" in out and "TRL completions parquet" in out
    assert "floor (order-0 entropy): ids" in out and "KB a rollout" in out
    assert "== pages" not in out  # write and disk only


def test_the_floor_is_the_order_0_entropy_of_what_was_written() -> None:
    """Two ids equally often: 1 bit a token; one logprob throughout: 0 bits."""
    import numpy as np

    from bench.scale_real import Floor

    floor = Floor()
    floor.add_arrays(np.array([3, 7, 3, 7]), np.full(4, -0.5))
    assert floor.bits() == (1.0, 0.0)
