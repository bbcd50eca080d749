"""bench/search_heap.py on a few thousand rows, so that it keeps running (a database of its own
on the test server). Its times are not checked; its layouts are: the narrow one must move the
words out of line, which is what it measures."""

from __future__ import annotations

import re

import pytest

from bench import search_heap
from tests.conftest import PG_URL


@pytest.mark.postgres
def test_the_search_heap_bench_runs_and_the_narrow_row_is_narrow(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert search_heap.main(["--pg", PG_URL, "--rows", "3000", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    heap = {
        name: (int(a.replace(",", "")), int(t.replace(",", "")))
        for name, a, t in re.findall(
            r"== (\w+): .*\n  heap ([\d,]+) B a row .*?TOAST ([\d,]+) B", out
        )
    }
    assert set(heap) == {"inline", "narrow"}
    assert (
        heap["inline"][1] < 10 < 500 < heap["narrow"][1]
    )  # the words went out of line (an empty TOAST table is an 8 KB index)
    assert heap["narrow"][0] * 4 < heap["inline"][0]
    assert "== ratio narrow/inline (p50)" in out and "prefix (" in out
