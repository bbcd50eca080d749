"""bench/pages.py in --quick mode, so that it keeps running: on SQLite and on PostgreSQL (a
database of its own on the test server). Its figures are not checked: times on a shared CI
machine mean little, and benches print them for people to read."""

from __future__ import annotations

import pytest

from bench import pages
from tests.conftest import PG_URL


@pytest.mark.postgres
def test_the_page_bench_runs_and_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert pages.main(["--quick", "--repeat", "2", "--pg", PG_URL]) == 0
    out = capsys.readouterr().out
    for database in ("== SQLite", "== PostgreSQL"):
        section = out.split(database, 1)[1].split("\n== ", 1)[0]
        for figure in (
            "step viewer (HTML)",
            "series: run page, cold",
            "runs page (HTML)",
            "runs JSON: live poll",
            "compare page (HTML)",
            "compare JSON",
            "chart data (figures and series)",
            "series: y",
        ):
            assert figure in section, (database, figure)
    assert "runs page, 200 runs (ms)" in out and "10 runs × 60 steps" in out
